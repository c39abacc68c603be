"""The engine: what runs one forward pass and one decode step of a compiled graph.

Owns the engine interface (``interface``: the versioned contract between a graph and its inputs, and
the engine folder's file names), the exported forward (``model``, ``paged_model``) and its tracing
bounds (``tracing``), the backends (``backends/``: ONNX Runtime, TensorRT, eager PyTorch) behind one
protocol (``engine``), the adapter's files and the inputs made of them (``adapter_config``, ``adapter``), the
paged cache and its quantized pages (``kv_blocks``, ``kv_pages``), the tokenizer, sampling and the decode loop
(``generate``), and the small pieces every layer above shares: ``errors``, ``hashing``,
``atomic_files``, ``latency``.

Imports neither ``runtime.release`` nor ``runtime.serve``. Only ``model``, ``paged_model``, the eager and
TensorRT backends and tracing take torch; the rest is the ONNX Runtime serving path.
"""
