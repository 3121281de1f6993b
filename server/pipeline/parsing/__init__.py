"""Turning a chat model's generated text into OpenAI's message parts: reasoning_content, content, tool_calls."""
