"""Dependency seams: jaxrl.parallel knows axis names only; one rules table shards both meshes;
the engine knows nothing of its HTTP face (jaxrl.serving builds on it) and neither knows the
rollout backends built on them; jaxrl.weight_transfer builds on jax alone; no import cycle
anywhere in jaxrl, type-only imports included."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "importing, forbidden",
    [
        # parallel knows axis names and meshes, not layers.
        ("jaxrl.parallel.mesh, jaxrl.parallel.rules, jaxrl.parallel.distributed",
         ("jaxrl.models", "jaxrl.trainer", "jaxrl.engine", "jaxrl.serving")),
        # Rollout backends produce a `jaxrl.endpoint.ModelEndpoint`; none of them knows the orchestrator
        # or the training run (the factory takes explicit parameters).
        (
            (
                "jaxrl.rollout.factory, jaxrl.rollout.vllm, jaxrl.rollout.external, jaxrl.rollout.embedded, "
                "jaxrl.serving.server"
            ),
            ("jaxrl.orchestrator", "jaxrl.run_common"),
        ),
        # The orchestrator reaches the engine over HTTP only (sampling ranges: jaxrl.sampling_contract).
        ("jaxrl.orchestrator.orchestrator, jaxrl.orchestrator.config, jaxrl.orchestrator.env_sampling",
         ("jaxrl.engine", "jaxrl.serving")),
    ],
)
def test_dependencies_point_one_way(importing: str, forbidden: tuple[str, ...]) -> None:
    code = (
        f"import sys, {importing};"
        f"bad = sorted(m for m in sys.modules if m.startswith({forbidden!r}));"
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]  # fmt: skip


def test_serving_and_training_meshes_shard_by_the_same_rules() -> None:
    from jaxrl.engine.weights import cache_sharding, param_sharding_fn, serving_mesh
    from jaxrl.models import sharding
    from jaxrl.parallel.mesh import MeshConfig, make_mesh

    train = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[:4])
    serve = serving_mesh(2)
    shape = (2, 64, 4, 16)  # wq [layers, embed, q_heads, head_dim]
    assert tuple(param_sharding_fn(serve)("wq", shape).spec) == (None, None, "tensor", None)
    # Training adds fsdp on embed; the serving mesh has no fsdp axis, so embed stays whole there.
    assert tuple(sharding.param_sharding_fn(train)("wq", shape).spec) == (None, "fsdp", "tensor", None)
    # KV cache [layers, rows, kv_heads, len, head_dim]: rows over the batch axes when training
    # meshes hold a cache, heads over tensor on both.
    cache = (2, 8, 2, 32, 16)
    assert tuple(cache_sharding(serve, cache).spec) == (None, None, "tensor", None, None)
    assert tuple(sharding.cache_sharding(train, cache).spec) == (None, "fsdp", "tensor", None, None)


# -- the static import graph (every import statement, lazy ones inside functions included) ---------


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((ROOT / "jaxrl").rglob("*.py"))}


def _imported(path: Path, *, type_checking: bool = False) -> set[str]:
    """The jaxrl modules ``path`` imports anywhere (module level or inside functions); those
    under ``if TYPE_CHECKING:`` (annotations only, never run) only with ``type_checking``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if not type_checking and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0 and child.module, f"{path}: relative import; write the absolute module"
                found.add(child.module)
                found.update(f"{child.module}.{a.name}" for a in child.names)  # `from pkg import module`
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return {m for m in found if m in MODULES}


IMPORTS = {name: _imported(path) for name, path in MODULES.items()}
TYPED_IMPORTS = {name: _imported(path, type_checking=True) for name, path in MODULES.items()}
"""``IMPORTS`` plus the type-only ones: a cycle through an annotation is a cycle all the same."""


def _reaches(start: str, forbidden: tuple[str, ...]) -> list[list[str]]:
    """Import chains from ``start`` to a module under one of the ``forbidden`` prefixes."""
    chains, seen, todo = [], {start}, [[start]]
    while todo:
        chain = todo.pop()
        for nxt in sorted(IMPORTS[chain[-1]]):
            if nxt.startswith(forbidden):
                chains.append([*chain, nxt])
            elif nxt not in seen:
                seen.add(nxt)
                todo.append([*chain, nxt])
    return chains


def test_the_engine_and_its_server_know_nothing_of_rollout_backends_or_the_run() -> None:
    inside = [m for m in MODULES if m.startswith(("jaxrl.engine", "jaxrl.serving"))]
    assert {"jaxrl.engine.engine", "jaxrl.serving.server"} <= set(inside)
    outside = ("jaxrl.rollout", "jaxrl.orchestrator", "jaxrl.run_common", "jaxrl.rl")  # and so no entry point
    bad = {m: c for m in inside if (c := _reaches(m, outside))}
    assert not bad, bad


def test_the_engine_knows_nothing_of_its_http_face() -> None:
    # As vLLM's engine core knows nothing of its OpenAI entrypoints: jaxrl.serving builds on the
    # engine (requests, completions, config), never the other way round.
    engine = [m for m in MODULES if m.startswith("jaxrl.engine")]
    assert "jaxrl.engine.engine" in engine and "jaxrl.engine.programs" in engine
    bad = {m: c for m in engine if (c := _reaches(m, ("jaxrl.serving",)))}
    assert not bad, bad
    assert any(m.startswith("jaxrl.engine") for m in IMPORTS["jaxrl.serving.server"])


BACKENDS = ("jaxrl.rollout.embedded", "jaxrl.rollout.colocated", "jaxrl.rollout.vllm", "jaxrl.rollout.external")
SHARED = (  # protocol, settings, helpers
    "jaxrl.rollout.base", "jaxrl.rollout.config", "jaxrl.rollout.proxy", "jaxrl.rollout.weight_files",
)


def test_each_rollout_backend_imports_only_the_protocol_and_shared_helpers() -> None:
    # As in Tunix's rl/rollout: a backend never imports another backend or the factory that picks
    # one, so each can be added, changed or removed alone; only the factory knows them all.
    assert set(BACKENDS) | set(SHARED) | {"jaxrl.rollout", "jaxrl.rollout.factory"} == {
        m for m in MODULES if m.startswith("jaxrl.rollout")
    }, "a new jaxrl.rollout module: list it in BACKENDS or SHARED"
    for backend in BACKENDS:
        siblings = {m for m in IMPORTS[backend] if m.startswith("jaxrl.rollout")}
        assert siblings <= set(SHARED), (backend, sorted(siblings - set(SHARED)))
    for helper in SHARED:
        siblings = {m for m in IMPORTS[helper] if m.startswith("jaxrl.rollout")}
        assert siblings <= {"jaxrl.rollout.base"}, (helper, sorted(siblings))
    assert set(BACKENDS) <= IMPORTS["jaxrl.rollout.factory"]


def test_weight_transfer_builds_on_jax_alone() -> None:
    # The trainer (publisher) and the engine (puller) both use it, so it may know neither: it
    # imports no jaxrl module outside itself, and so nothing of models, trainer, engine or the run.
    inside = [m for m in MODULES if m.startswith("jaxrl.weight_transfer")]
    assert {"jaxrl.weight_transfer.publisher", "jaxrl.weight_transfer.puller"} <= set(inside)
    bad = {m: sorted(i for i in TYPED_IMPORTS[m] if not i.startswith("jaxrl.weight_transfer")) for m in inside}
    assert not any(bad.values()), bad


def test_no_import_cycle_among_jaxrl_modules() -> None:
    # Depth-first search over every import, type-only ones included; a back edge (to a module
    # still on the stack) closes a cycle.
    state: dict[str, str] = {}  # "open" while on the stack, "done" after

    def dfs(module: str, stack: list[str]) -> list[str] | None:
        state[module] = "open"
        for nxt in sorted(TYPED_IMPORTS[module]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := dfs(nxt, [*stack, nxt])):
                return cycle
        state[module] = "done"
        return None

    assert len(MODULES) > 50 and IMPORTS["jaxrl.rl"] >= {"jaxrl.rollout.factory", "jaxrl.rollout.base"}
    for module in MODULES:
        if module not in state:
            cycle = dfs(module, [module])
            assert cycle is None, " -> ".join(cycle)
