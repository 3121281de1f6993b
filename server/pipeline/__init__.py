"""What every dialect shares: a ChatCall prepared into engine requests, run and streamed (chat.py); the prompt
(tokenization.py, render.py, fim.py), tools (tools.py), the output parsers (parsing/), sampling and structured
output fields -> SamplingParams, logprobs in each shape, SSE framing and the Unicode check at the edge."""
