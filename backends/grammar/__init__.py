"""Grammar backends for structured output (the contract is GrammarBackend in backends/base.py)."""
