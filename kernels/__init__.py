"""Numerics of the quantized KV cache: quantize, dequantize, bit-pack (all ONNX-exportable).

Import from the modules: ``kernels.kv_spec`` (the scheme, torch-free), ``kernels.kv_quant``,
``kernels.gqa_attention``. This file stays import-free on purpose: transformers
probes for Hugging Face's own ``kernels`` package by importing whatever ``kernels`` is on
the path, so anything heavy or fragile here would run inside every ``import transformers``.
"""
