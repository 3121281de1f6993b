"""The 'mooncake' store: KV pages in Mooncake Store (optional extra ``tierlm[mooncake]``). storage.py is the
KVStorage adapter; its docstring lists the other modules. Nothing here imports the mooncake package until the store
is opened (connection.import_store_class)."""
