"""Fixtures of the benchmark tests."""

import pytest


@pytest.fixture
def llama_peer():
    """(the llama_cpp module, the llama.cpp directory with its GGUF converter), or a skip saying which is missing."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (the `peer` extra: make bench-peer)")
    from bench.lib.llama_cpp_peer import converter_dir

    try:
        return llama_cpp, converter_dir()
    except SystemExit as err:
        pytest.skip(f"llama-cpp-python sdist not found: {err}")
