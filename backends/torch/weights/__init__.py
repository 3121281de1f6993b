"""Weight formats of the torch backend: quantized layers (int8 / int4 weight-only, torchao, compressed-tensors
checkpoints, gpt-oss's packed MXFP4 experts) and float32 weights held in their 16 bits."""
