"""Config keys prime-rl users bring, and what jaxrl calls them.

A prime-rl TOML moved to jaxrl should fail with the name of the key to use, not pydantic's bare
"extra inputs are not permitted". Each config model that prime-rl had a counterpart of lists
the keys it renamed and rejects them before field validation (`reject_renamed`); the run config
first walks the whole file (`find_renamed`) so that one error names every renamed key, by its
full dotted path, with its jaxrl spelling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RUN = {
    "max_steps": "trainer.steps",
    "seq_len": "trainer.seq_len",
    "monitors": "[log.wandb] (W&B: project, entity, name, tags, mode) and `log.tensorboard`",
}
ORCHESTRATOR = {
    "sampling": "[orchestrator.train.sampling]",
    "env": "[[orchestrator.train.env]]",
    "rollouts_per_example": "orchestrator.group_size",
    "async_level": "orchestrator.max_async_level",
    "max_off_policy_steps": "orchestrator.max_async_level",
    "seq_len": "trainer.seq_len",
    "max_steps": "trainer.steps",
    "algo": "[orchestrator.train.env.algo] (set per env)",
    "output_dir": "output_dir (top level)",
}
TRAIN_SPLIT = {
    "source": "[[orchestrator.train.env]] (one entry per env: `id`, `args` for its taskset, `ratio` for its "
    "share of each batch; its algorithm and sampling in that entry's `algo` / `sampling` tables)",
}
EVAL = {
    "source": "[[orchestrator.eval.env]]",
    "num_examples": "orchestrator.eval.num_tasks",
    "rollouts_per_example": "orchestrator.eval.k",
    "group_size": "orchestrator.eval.k",
}
SAMPLING = {
    "max_tokens": "max_completion_tokens",
}
ENV = {
    "num_workers": "pool_size",
    "rollouts_per_example": "group_size",
    "num_examples": "args.num_tasks (or orchestrator.eval.num_tasks)",
}


def _renamed_to(old: str, new: str) -> str:
    """The line for one renamed key; a note after the new name stays outside its backticks."""
    name, sep, note = new.partition(" (")
    return f"`{old}` was renamed to `{name}`" + (f" ({note}" if sep else "")


def reject_renamed(data: Any, renamed: Mapping[str, str]) -> Any:
    """`data` unchanged, or a ValueError naming each prime-rl key in it and its jaxrl name."""
    if isinstance(data, Mapping):
        found = [_renamed_to(old, new) for old, new in renamed.items() if old in data]
        if found:
            raise ValueError("prime-rl key(s): " + "; ".join(found))
    return data


def _entries(value: Any) -> list[tuple[str, Mapping]]:
    """(suffix, table) of a table or of each entry of an array of tables."""
    if isinstance(value, Mapping):
        return [("", value)]
    if isinstance(value, list):
        return [(f"[{i}]", v) for i, v in enumerate(value) if isinstance(v, Mapping)]
    return []


# path in the run config -> (renames of that table, its sub-tables to visit)
_TREE: dict[str, tuple[Mapping[str, str], tuple[str, ...]]] = {
    "": (RUN, ("orchestrator",)),
    "orchestrator": (ORCHESTRATOR, ("train", "eval", "sampling", "env")),
    "orchestrator.train": (TRAIN_SPLIT, ("sampling", "env", "source")),
    "orchestrator.eval": (TRAIN_SPLIT | EVAL, ("sampling", "env", "source")),
}
_LEAVES = {"sampling": SAMPLING, "env": ENV, "source": ENV}


def find_renamed(run: Any) -> list[str]:
    """Every prime-rl key in a whole run config (dict), as "`path` was renamed to `new`"."""
    found: list[str] = []

    def visit(path: str, table: Mapping) -> None:
        renames, children = _TREE[path]
        prefix = f"{path}." if path else ""
        found.extend(
            _renamed_to(f"{prefix}{old}", new) for old, new in renames.items() if old in table
        )
        for child in children:
            where = f"{prefix}{child}"
            for suffix, sub in _entries(table.get(child)):
                if where in _TREE:
                    visit(where, sub)
                else:
                    leaf = _LEAVES[child]
                    found.extend(
                        _renamed_to(f"{where}{suffix}.{old}", new)
                        for old, new in leaf.items()
                        if old in sub
                    )
                    for suffix2, nested in _entries(sub.get("sampling")) if child != "sampling" else []:
                        found.extend(
                            _renamed_to(f"{where}{suffix}.sampling{suffix2}.{old}", new)
                            for old, new in SAMPLING.items()
                            if old in nested
                        )

    if isinstance(run, Mapping):
        visit("", run)
    return found
