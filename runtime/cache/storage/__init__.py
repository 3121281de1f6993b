"""L3: KV pages in a store that outlives the server (files, Mooncake), by name: the contract and its machinery here,
each store its own package under stores/."""
