"""Serving benchmarks: the device server under load (throughput, hot swaps, faults, memory, mixed adapters)."""
