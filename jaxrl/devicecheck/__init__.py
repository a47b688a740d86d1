"""The device check: one prepared run of correctness checks and benchmarks on whatever
accelerator jax sees (``python -m jaxrl.devicecheck``; ``run.py`` says what it measures).

It lives in the package, not in bench/, so that it runs from an installed wheel on an air-gapped
accelerator host with no repository checkout (docs/accelerator.md). Nothing else in jaxrl imports it.
"""
