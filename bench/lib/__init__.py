"""What the benchmarks share; no benchmark imports another, only this package (and the project's own).

    report.py           the JSON a benchmark writes, stamped with its command, dates and load; ``Figure``
    timing.py           interleaved rounds of steps, an engine's decode and prefill step
    tables.py           the one table printer (text or Markdown) and the shared cell formats
    charts.py           a benchmark's PNG beside its JSON
    divergence.py       log-probabilities; the KL and top-1 agreement of two engines
    backbones.py        random backbones, adapters and the engines built from them
    worlds.py           backbones with engines and signed releases, for the serving benchmarks
    real_checkpoint.py  a real checkpoint's text and served engine
    llama_cpp_peer.py   llama.cpp: install, converters, GGUF files, decoding, llama-server
    servers.py          a server in its own process
    serve_client.py     timed HTTP clients of a server
    flow_project.py     a clone-like copy of the project for the monthly flow, and its tracking store
"""
