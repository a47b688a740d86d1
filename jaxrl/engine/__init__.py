"""jaxrl.engine: the embedded JAX rollout engine (its HTTP face is ``jaxrl.serving``).

    config.py        EngineConfig = SharedSettings (``[inference]``'s sizes, read by every backend)
                     + EngineSettings (``[inference.backend]`` of type "embedded"; the section
                     itself, with the backends and the HTTP server: ``jaxrl.rollout.config``)
    sampling.py      SamplingParams; on-device sampling and the log-prob reported per token
    requests.py      Request / Sequence / TokenDelta / Completion: what the engine is asked and answers
    scheduler.py     continuous batching: admission, which sequences run in which call
    prefix_cache.py  the KV cache rows' table: owners, warm rows, sessions, prefix origins
    runner.py        ModelRunner: weights and their swaps, KV cache, token counts, device calls
    programs.py      the jitted prefill / decode / copy programs and the cache layout
    engine.py        Engine: scheduler + runner; the background step loop (schedule -> execute
                     -> update), weight updates (drain / immediate), recovery from a failed step
    metrics.py       EngineMetrics: what the engine reports about itself (``GET /metrics``, ``/metrics.json``)
    weights.py       serving shardings (tensor parallel) and the trainer -> engine hand-off

Nothing here imports ``jaxrl.serving``, ``jaxrl.rollout``, the orchestrator or the trainer's run
(``tests/test_seams.py``). Import the submodules directly; this package imports nothing heavy on
its own (the root config imports ``jaxrl.engine.config``).
"""
