"""OpenAI's chat completions and text completions, and the OpenAI request/response models (protocol.py) whose
ChatCompletionRequest is what every chat dialect is converted into."""
