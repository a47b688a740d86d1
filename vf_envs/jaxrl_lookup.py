"""`vf-eval jaxrl-lookup` (or `jaxrl_lookup`): jaxrl's built-in lookup env.

verifiers' CLI imports a taskset id as a top-level module and takes the Taskset (and harness,
env) its `__all__` exports; this module is `jaxrl.envs.lookup` under such a name.
"""

from jaxrl.envs.lookup import *
from jaxrl.envs.lookup import __all__  # noqa: F401
