"""Engine benchmarks: one engine's decode and prefill, against eager PyTorch, other caches and weights, llama.cpp,
and the GPU checks (``gpu_check``, ``make gpu-check``)."""
