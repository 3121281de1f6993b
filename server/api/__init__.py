"""The wire dialects, one folder each: its request/response models (its protocol.py), its converter into the pipeline's
one call record (server/pipeline/chat.py, ``ChatCall``), its routes and its stream writer.

- openai/: /v1/chat/completions, /v1/completions (and the OpenAI models the others build on);
- anthropic/: /v1/messages, /v1/messages/count_tokens;
- responses/: /v1/responses;
- native/: SGLang's and llama.cpp's own routes (/generate, /infill, /tokenize, health and info) and /tiers.
"""
