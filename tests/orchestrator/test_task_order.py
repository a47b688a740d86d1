"""The task sampler: env mixing by ratio, deterministic and resumable."""

from __future__ import annotations

from jaxrl.orchestrator.task_order import TaskSampler

TASKS = {"a": [{"idx": i} for i in range(5)], "b": [{"idx": i} for i in range(5)]}


def draws(sampler: TaskSampler, n: int) -> list[str]:
    return [sampler.next()[0] for _ in range(n)]


def test_equal_ratios_alternate():
    assert draws(TaskSampler(TASKS, seed=0), 6) == ["a", "b", "a", "b", "a", "b"]


def test_ratios_set_the_share_of_groups():
    sampler = TaskSampler(TASKS, seed=0, ratios={"a": 3.0, "b": 1.0})
    assert draws(sampler, 8) == ["a", "a", "b", "a", "a", "a", "b", "a"]  # ties go to config order
    # every prefix is within one group of the exact 3:1 share
    sampler = TaskSampler(TASKS, seed=0, ratios={"a": 3.0, "b": 1.0})
    seen = draws(sampler, 400)
    assert all(abs(seen[:n].count("a") - 0.75 * n) <= 1 for n in range(1, 401))


def test_a_restored_sampler_continues_the_schedule():
    ratios = {"a": 2.0, "b": 1.0}
    first = TaskSampler(TASKS, seed=1, ratios=ratios)
    draws(first, 7)
    resumed = TaskSampler(TASKS, seed=1, ratios=ratios)
    resumed.load_state_dict(first.state_dict())
    assert [first.next() for _ in range(9)] == [resumed.next() for _ in range(9)]
