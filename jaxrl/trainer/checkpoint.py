"""Orbax checkpoints of the whole run: params, optimizer state, step and a JSON of the rest
(data iterator position, RNG, orchestrator state), with keep-last-N and async saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from pydantic import BaseModel, ConfigDict, Field


class CkptConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    interval: int = Field(0, ge=0)
    """Save every N optimizer steps (0: only at the end and on SIGTERM/SIGINT)."""
    keep: int = Field(2, ge=1)
    """Checkpoints kept on disk (oldest deleted first)."""
    async_save: bool = True
    """Write in a background thread while training continues."""
    dir: str | None = None
    """Where checkpoints live; default <output_dir>/checkpoints."""


def abstract_like(tree: Any) -> Any:
    """Shape/dtype/sharding skeleton of ``tree`` (the restore target)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: CkptConfig):
        self.dir = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True
        )
        self._mngr = ocp.CheckpointManager(self.dir, options=options)

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Save arrays (``state``) and JSON-able ``meta`` for ``step`` (async if configured)."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._mngr.save(step, args=args, force=True)

    def restore(self, step: int, target: Any) -> tuple[Any, dict[str, Any]]:
        """Arrays restored onto ``target``'s shardings, plus the saved meta."""
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_like(target)), meta=ocp.args.JsonRestore()
        )
        out = self._mngr.restore(step, args=args)
        return out["state"], dict(out["meta"])

    def meta(self, step: int) -> dict[str, Any]:
        """The JSON meta saved with ``step`` alone (no arrays read): checked before a restore."""
        out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()
