"""Fixtures of the benchmark tests."""

import pytest


@pytest.fixture
def llama_peer():
    """(the llama_cpp module, the llama.cpp directory with its GGUF converter), or a skip saying which is missing."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (the `peer` extra: make bench-peer)")
    from bench import llama_cpp_bench as peer

    try:
        return llama_cpp, peer.converter_dir()
    except SystemExit as err:
        pytest.skip(f"llama-cpp-python sdist not found: {err}")
