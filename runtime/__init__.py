"""The device side: three packages, each with one job, and the command line over them (``python -m runtime``).

    engine/   runs a compiled graph: interface, exported forward, backends, adapter and KV-scale inputs,
              tokenizer, sampling, the decode loop. Imports neither of the others.
    release/  the trust chain of a release: contract, signing, verification, pull over DVC and TUF,
              the device state. Imports the engine only for what verifying a release needs.
    serve/    the HTTP server: ASGI app, OpenAI wire format, batcher, residents, health gate, channel
              watcher, metrics, uvicorn. Imports both.

Nothing here imports Prefect, MLflow, DVC or ``tasks/``, nor torch on the ONNX Runtime serving path
(tests/runtime/test_boundaries.py).
"""
