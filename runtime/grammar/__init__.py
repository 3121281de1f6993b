"""Structured output in the runtime: which grammar a request asks for (spec.py), the compile pool and its cache,
and each request's matcher between scheduler steps (manager.py). The tensors (bitmask application) are the
backends'; the grammar compiler is a GrammarBackend (backends/base.py) chosen by runtime/engine_setup.py."""
