"""jaxrl.rollout: the servers the RL loop samples rollouts from, behind one protocol.

    base.py          RolloutBackend (the protocol the RL loop drives) and RolloutServerDead
    config.py        InferenceConfig (``[inference]``) and the backends' settings, a union on ``type``
                     (the embedded one's: the engine's own), and the older spellings' translation
    embedded.py      EmbeddedBackend: jaxrl's engine in this process (``jaxrl.engine`` behind
                     ``jaxrl.serving``)
    vllm.py          VLLMBackend: a vLLM server launched beside the run, or attached to
    external.py      ExternalBackend: jaxrl.serve / vLLM servers running elsewhere
    proxy.py         the loopback balancer + log-prob rewriter env servers reach them through
    weight_files.py  weights as HF safetensors per policy version; vLLM's reload protocol
    factory.py       start_rollout_backend: ``[inference] backend`` -> a started backend

Each backend imports only ``base`` (and the shared ``proxy`` / ``weight_files`` helpers) from
this package; only ``factory`` knows them all. Nothing in ``jaxrl.engine`` or ``jaxrl.serving``
imports this package. Import the submodules directly; this package imports nothing on its own.
"""
