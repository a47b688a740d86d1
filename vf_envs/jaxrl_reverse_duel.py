"""`vf-eval jaxrl-reverse-duel` (or `jaxrl_reverse_duel`): jaxrl's built-in reverse_duel env.

verifiers' CLI imports a taskset id as a top-level module and takes the Taskset (and harness,
env) its `__all__` exports; this module is `jaxrl.envs.reverse_duel` under such a name.
"""

from jaxrl.envs.reverse_duel import *
from jaxrl.envs.reverse_duel import __all__  # noqa: F401
