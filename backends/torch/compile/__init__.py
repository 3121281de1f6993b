"""The compiled decode step on CPU: the decoder stack through torch.compile (inductor), and its direct call."""
