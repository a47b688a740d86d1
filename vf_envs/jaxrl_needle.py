"""`vf-eval jaxrl-needle` (or `jaxrl_needle`): jaxrl's built-in needle env.

verifiers' CLI imports a taskset id as a top-level module and takes the Taskset (and harness,
env) its `__all__` exports; this module is `jaxrl.envs.needle` under such a name.
"""

from jaxrl.envs.needle import *
from jaxrl.envs.needle import __all__  # noqa: F401
