"""`vf-eval jaxrl-alphabet-sort` (or `jaxrl_alphabet_sort`): jaxrl's built-in alphabet_sort env.

verifiers' CLI imports a taskset id as a top-level module and takes the Taskset (and harness,
env) its `__all__` exports; this module is `jaxrl.envs.alphabet_sort` under such a name.
"""

from jaxrl.envs.alphabet_sort import *
from jaxrl.envs.alphabet_sort import __all__  # noqa: F401
