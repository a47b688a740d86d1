"""Pallas kernels for jaxrl, each beside a pure-JAX reference.

Kept free of imports on purpose: transformers probes for a top-level package named
``kernels`` (Hugging Face's) and may import it to read ``__version__``; importing jax here
would make every ``import transformers`` pay for it.
"""

__version__ = "0.1.0"
