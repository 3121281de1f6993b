"""L3: KV pages in a store that outlives the server (files, Mooncake), by name."""
