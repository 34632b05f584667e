"""Built-in quantizers (docs/quantization.md), each registered through its own ``ember``
entry point: weight-only int8/int4 of a float checkpoint at load, and the readers of
GPTQ, AWQ, compressed-tensors, bitsandbytes and fp8 checkpoints."""
