"""Ahead-of-time compiles for TPU targets: will this run fit, before a slice is booked?

``plan(cfg, topology)`` compiles the programs a run executes (``jaxrl.aot.programs``) for a
named TPU topology through libtpu's compile-only client (``jaxrl.aot.topology``), from abstract
shapes: no weights are allocated and no TPU is needed. ``python -m jaxrl.aot`` is the command.
"""

from jaxrl.aot.programs import ProgramFit, RunShapes, plan, run_shapes
from jaxrl.aot.topology import Topology, get_topology

__all__ = ["ProgramFit", "RunShapes", "Topology", "get_topology", "plan", "run_shapes"]
