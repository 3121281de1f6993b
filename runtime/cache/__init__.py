"""The KV cache: device pages (L1) in a radix tree, host pages (L2) and storage (L3) under it."""
