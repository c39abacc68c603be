"""Numerics of the quantized KV cache: quantize, dequantize, bit-pack (all ONNX-exportable)."""

from kernels.kv_quant import (
    KVQuantSpec,
    QuantizedKVCache,
    bytes_per_token,
    dequantize,
    pack_bits,
    packed_size,
    quantize,
    quantize_per_channel,
    quantize_per_token,
    rope_rotate,
    unpack_bits,
)

__all__ = [
    "KVQuantSpec",
    "QuantizedKVCache",
    "bytes_per_token",
    "dequantize",
    "pack_bits",
    "packed_size",
    "quantize",
    "quantize_per_channel",
    "quantize_per_token",
    "rope_rotate",
    "unpack_bits",
]
