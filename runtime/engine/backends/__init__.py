"""Engine backends: ONNX Runtime (CPU), TensorRT (NVIDIA GPU), eager PyTorch (reference)."""
