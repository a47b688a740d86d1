"""Test-wide setup: 8 virtual CPU devices (sharded paths run on a real 8-device mesh)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
