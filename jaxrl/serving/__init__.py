"""jaxrl.serving: the engine's vLLM-compatible HTTP API (DESIGN contract 6), laid out as vLLM's
OpenAI entrypoints: thin routes, one serving class per endpoint family, bodies in ``protocol``.

    server.py            EngineServer (routes, start / stop / serve_forever) and
                         build_engine_server (one engine behind its server: jaxrl.serve, RL loop)
    config.py            ServerConfig (``[inference.server]``)
    protocol.py          request / response bodies and the schema the server publishes
    completions.py       /inference/v1/generate and /v1/completions
    chat.py              /v1/chat/completions (rendering, tool calls)
    errors.py            OpenAI's error body; a 400 naming the field
    auth.py              who may update weights, and from where
    http_thread.py       an ASGI app served by uvicorn in a background thread
    template_sandbox.py  request-supplied chat templates rendered in a bounded child process

Builds on ``jaxrl.engine``; nothing here imports ``jaxrl.rollout``, the orchestrator or the run.
``python -m jaxrl.serve`` (``jaxrl/serve.py``) is the entry point.
"""
