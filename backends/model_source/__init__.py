"""tierlm.backends.model_source: where a model folder comes from, and what can be read from it unloaded.

    resolve.py       --model-path -> a local folder: the built-in model, a local folder, or a hub id (hub.py)
    builtin_model.py the built-in model, stories260K/ (`tierlm serve` with no --model-path)
    demo.py          a tiny random Llama built on demand (tests: the server's chat, tools and grammar paths)
    synthetic.py     seeded random weights in published shapes (`tierlm bench --synthetic`)
    tokenizer.py     loading a folder's tokenizer; the byte-level tokenizer tierlm's own models carry
    model_folder.py  ModelFolder: a folder read once (config.json, generation_config.json, weight files, EOS ids)
    folder_facts.py  KV bytes per token and weight bytes (doctor, bench)
    fingerprint.py   the model fingerprint that namespaces L3 pages

Nothing here touches a device; both backends and the tools (doctor, bench) read models through it. Failures
raise ModelSourceError with the fix in its message.
"""
from tierlm.backends.model_source.errors import ModelSourceError
from tierlm.backends.model_source.resolve import resolve_model_path

__all__ = ["ModelSourceError", "resolve_model_path"]
