"""Test-wide setup: 8 virtual CPU devices (sharded paths run on a real 8-device mesh), one
compilation cache for the run, and compiled programs let go of after each test module."""

import atexit
import gc
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/helpers.py

from xla_flags import cpu_devices

os.environ.setdefault("XLA_FLAGS", cpu_devices(8))  # with the fast-compile flags (xla_flags.py)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Most of the suite's time is XLA compiling the same few programs of the tiny models again: each
# run_sft / run_rl / Engine builds its own jit objects, so jax's in-memory cache never sees the
# program twice. JAX's persistent cache, keyed by the program itself, does, across tests and the
# processes they start (the variables are inherited). One fresh folder per run: every run
# starts cold, so its time does not depend on what ran before, and nothing is left behind.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="jaxrl-tests-xla-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

from budget import pytest_addoption, pytest_configure  # noqa: F401  the time and memory budget (hooks found by name)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each module, drop jax's in-memory compiled programs: kept for the whole run they
    grew one pytest process to 22 GB. A later module that needs one again reads it from the
    persistent cache above (tenths of a second, not a compile)."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()


@pytest.fixture(scope="module")
def one_process_tree_at_a_time(tmp_path_factory: pytest.TempPathFactory):
    """Modules that start process trees of their own (env servers, trainer processes, rollout
    servers: 2.3-2.9 GB each with their xdist worker) run one at a time across the workers: two
    of them side by side took the fast tier's sampled peak to 6.1 GB of its 6 GB budget in a CI
    rehearsal (2026-11-30), where the rest of the suite peaks under 5. A module takes an
    exclusive lock on a file the workers share for as long as it runs; a worker given another
    such module meanwhile waits for it. ``fcntl.flock``: the lock goes with the process if it
    dies."""
    import fcntl

    shared = tmp_path_factory.getbasetemp().parent  # one folder above each xdist worker's own
    with open(shared / "process-trees.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
