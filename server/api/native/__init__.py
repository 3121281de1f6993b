"""The routes that are not a chat dialect: SGLang's /generate, llama.cpp's /infill, /tokenize and /detokenize,
health, model and server info, cache flush, metrics, and tierlm's /tiers."""
