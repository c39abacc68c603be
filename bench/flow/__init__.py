"""Flow benchmarks: the monthly flow's wall time and engine builds, on the default and at Qwen2-0.5B's shape."""
