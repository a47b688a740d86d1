"""jaxrl: JAX/TPU-native reinforcement learning for large language models."""

__version__ = "0.1.0"
