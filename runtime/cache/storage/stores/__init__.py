"""The L3 stores, one package each (file/, mooncake/), found by name through ../registry.py; each implements the
contract of ../base.py with the machinery beside it (page keys, page header, namespace, storage_io)."""
