"""jaxrl.inference: the embedded JAX rollout engine and its vLLM-compatible HTTP server.

    config.py            InferenceConfig / ServerConfig (the ``[inference]`` section, which also
                         picks the rollout backend and holds the vLLM / external-server settings)
    sampling.py          SamplingParams; on-device sampling and the log-prob reported per token
    scheduler.py         Request / Completion; continuous batching, KV cache rows, prefix reuse
    engine.py            Engine: prefill + decode programs, background step loop, weight updates
    engine_metrics.py    EngineMetrics: what the engine reports about itself (``GET /metrics``)
    weights.py           serving shardings (tensor parallel) and the trainer -> engine hand-off
    api.py               request / response bodies of the HTTP API (DESIGN contract 6)
    template_sandbox.py  request-supplied chat templates rendered in a bounded child process
    server.py            EngineServer: FastAPI + uvicorn over an Engine
    http_thread.py       an ASGI app served by uvicorn in a background thread
    serving.py           build_engine_server: an Engine behind its server (jaxrl.serve, RL loop)

The RL loop's rollout backends (this engine, vLLM, external servers) live in ``jaxrl.rollout``,
which imports this package; nothing here imports ``jaxrl.rollout``, the orchestrator or the
trainer. Import the submodules directly; this package imports nothing heavy on its own (the
root config imports ``jaxrl.inference.config``).
"""
