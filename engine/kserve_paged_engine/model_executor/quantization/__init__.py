"""Weight formats: which layout each projection gets (layouts.py) and the readers of quantized
checkpoints (GGUF, AWQ/GPTQ int4, compressed-tensors, FP8)."""
