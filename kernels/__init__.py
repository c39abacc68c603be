"""Numerics of the quantized KV cache and weights (all ONNX-exportable).

Import from the modules: ``kernels.kv_spec`` (the pages' scheme, torch-free), ``kernels.page_quant``,
``kernels.bit_packing``, ``kernels.rope``, ``kernels.weight_quant``. This file stays import-free on purpose:
transformers probes for Hugging Face's own ``kernels`` package by importing whatever ``kernels`` is on the path, so
anything heavy or fragile here would run inside every ``import transformers``.
"""
