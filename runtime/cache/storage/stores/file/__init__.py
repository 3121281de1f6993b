"""The 'file' store: one file per KV page in a folder (storage.py), its folder and bound (config.py) and the system
calls on page files (page_io.py)."""
