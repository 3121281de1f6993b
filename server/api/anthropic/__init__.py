"""Anthropic's Messages API (Claude Code): the request models, their conversion into a ChatCall (cache_control
breakpoints -> pins included), content blocks and the event stream, and errors in Anthropic's shape."""
