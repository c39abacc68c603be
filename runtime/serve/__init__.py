"""The device's HTTP server: releases in memory answering OpenAI-shaped requests.

Owns the ASGI app (``http_app``) and its uvicorn server (``http_server``), the OpenAI wire format
(``openai_api``), the server over its resident releases (``server``, ``residents``), a request's
generation (``generation``) and the continuous batcher (``batcher``), the health gate that commits or
reverts a new champion (``health``), the update-channel watcher (``channel_watch``) and the Prometheus
metrics (``metrics``).

May import ``runtime.release`` and ``runtime.engine``; nothing imports it but ``runtime.__main__``.
Torch-free.
"""
