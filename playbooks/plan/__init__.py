"""Pure planning: model shapes, tensor sizes per quant, KV cache, GPUs, the VRAM budget and roofline.

No I/O beyond reading a model config file; never imports the host layer."""
