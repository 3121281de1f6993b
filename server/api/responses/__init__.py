"""OpenAI's Responses API (Codex CLI): input items -> a ChatCall, the prompt that continues an earlier turn's exact
tokens, output items and their stream events, the in-memory response store and encrypted_content blobs."""
