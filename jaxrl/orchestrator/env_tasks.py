"""An env's tasks, loaded on the orchestrator side (verifiers 0.4's servers have no list-tasks
call), and the wire form a server rebuilds each task from."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import verifiers.v1 as vf


def load_taskset(vf_config: vf.EnvConfig) -> vf.Taskset:
    """The env's taskset, loaded here (iterate it, or `select`/`shuffle`/`take` views)."""
    from verifiers.v1 import load_taskset as load

    return load(vf_config.taskset)


def task_data(task: vf.Task) -> dict:
    """A task's wire data, as an env server rebuilds the task from it."""
    return task.data.model_dump(mode="json")
