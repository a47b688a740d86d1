"""jaxrl.inference: the embedded JAX rollout engine and its vLLM-compatible HTTP server.

    config.py     InferenceConfig / ServerConfig (the ``[inference]`` section)
    sampling.py   SamplingParams; on-device sampling and the log-prob reported per token
    scheduler.py  Request / Completion; continuous batching, KV cache rows, prefix reuse
    engine.py     Engine: prefill + decode programs, background step loop, weight updates
    weights.py    serving shardings (tensor parallel) and the trainer -> engine hand-off
    api.py        request / response bodies of the HTTP API (DESIGN contract 6)
    server.py     EngineServer: FastAPI + uvicorn over an Engine

Import the submodules directly; this package imports nothing heavy on its own (the root
config imports ``jaxrl.inference.config``).
"""
