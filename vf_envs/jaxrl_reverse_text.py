"""`vf-eval jaxrl-reverse-text` (or `jaxrl_reverse_text`): jaxrl's built-in reverse_text env.

verifiers' CLI imports a taskset id as a top-level module and takes the Taskset (and harness,
env) its `__all__` exports; this module is `jaxrl.envs.reverse_text` under such a name.
"""

from jaxrl.envs.reverse_text import *
from jaxrl.envs.reverse_text import __all__  # noqa: F401
