"""Fixtures of the engine tests: see tests/engine_testkit.py."""

from engine_testkit import qwen_adapter, tiny_engine, tiny_llama, tiny_qwen  # noqa: F401  (fixtures)
