"""jaxrl.engine: the embedded JAX rollout engine (its HTTP face is ``jaxrl.serving``).

    config.py        EngineConfig: the sizes of ``[inference]`` (the section itself, with the
                     rollout backend and the HTTP server: ``jaxrl.rollout.config``)
    sampling.py      SamplingParams; on-device sampling and the log-prob reported per token
    scheduler.py     Request / Completion; continuous batching, KV cache rows, prefix reuse
    programs.py      the model runner side: jitted prefill / decode programs and the cache layout
    engine.py        Engine: the background step loop (schedule -> run programs -> deliver)
    weight_swap.py   weight hand-offs and when they take effect (drain / immediate)
    recovery.py      failing the requests of a broken step and serving on
    metrics.py       EngineMetrics: what the engine reports about itself (``GET /metrics``)
    weights.py       serving shardings (tensor parallel) and the trainer -> engine hand-off

Nothing here imports ``jaxrl.serving``, ``jaxrl.rollout``, the orchestrator or the trainer's run
(``tests/test_seams.py``). Import the submodules directly; this package imports nothing heavy on
its own (the root config imports ``jaxrl.engine.config``).
"""
