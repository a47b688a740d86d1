"""The orchestrator: env servers + rollout dispatch in a background asyncio thread, handing the
training loop finished groups with bounded off-policy lag.

Groups are produced *for a step*. Groups for step ``s`` are dispatched only once the engine
serves policy version >= ``s - 1 - max_async_level`` (the trainer's version before step s is
s - 1), so every rollout trained at step s was sampled by a policy no older than
``s - 1 - max_async_level``: with the default ``max_async_level = 1`` the next step's rollouts
are generated while the trainer works on this one. Each rollout carries the version it was
dispatched under (the oldest policy that can have produced it).

Every rollout samples with its own seed, a hash of (run seed, split, which draw, which sample):
train groups by their task sampler draw (checkpointed, so a resumed run samples what the
uninterrupted one would have), eval by (env, task, sample), the same at every eval. So a run
does not depend on the order in which requests reach the engine, and successive evals compare
policies on common random numbers: the change in eval reward is the policy's, not the dice's.

The orchestrator reaches the engine only over HTTP (through the env servers) and hands the
trainer samples, never traces.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxrl.endpoint import ModelEndpoint
from jaxrl.orchestrator.algo import Algorithm, make_algorithm
from jaxrl.orchestrator.config import EnvConfig, EvalConfig, OrchestratorConfig, SamplingConfig
from jaxrl.orchestrator.env_config import verifiers_env_config
from jaxrl.orchestrator.env_process import EnvServerDead
from jaxrl.orchestrator.env_server import EnvServer, start_env_servers
from jaxrl.orchestrator.env_tasks import task_data
from jaxrl.orchestrator.task_order import TaskSampler
from jaxrl.orchestrator.traces import Rollout, attach_token_versions
from jaxrl.sampling_contract import JSON_INT64_MAX

logger = logging.getLogger(__name__)


@dataclass
class Group:
    env: str
    step: int
    rollouts: list[Rollout]
    dispatch_version: int
    seconds: float


@dataclass
class _StepQueue:
    groups: list[Group] = field(default_factory=list)
    dispatched: int = 0


def sampling_params(s: SamplingConfig) -> dict[str, Any]:
    """The verifiers SamplingConfig fields (extra keys like top_k pass through to the engine)."""
    out: dict[str, Any] = {"max_completion_tokens": s.max_completion_tokens, "temperature": s.temperature, "top_p": s.top_p}
    if s.top_k > 0:
        out["top_k"] = s.top_k
    return out


def rollout_seeds(run_seed: int, *key: object, n: int) -> list[int]:
    """``n`` sampling seeds (one per rollout of a group) determined by ``(run_seed, *key)``."""

    def one(i: int) -> int:
        text = "/".join(map(str, (run_seed, *key, i)))
        # < 2**63; the modulus (which leaves all but 512 in 2**63 of them as they are) keeps them
        # within the seeds an inference server accepts (``JSON_INT64_MAX``).
        return (int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest()) >> 1) % (JSON_INT64_MAX + 1)

    return [one(i) for i in range(n)]


def eval_enabled(cfg: OrchestratorConfig) -> bool:
    """Whether the run evaluates at all (`[orchestrator.eval]` set with interval > 0)."""
    return cfg.eval is not None and cfg.eval.interval > 0


def eval_env_configs(cfg: OrchestratorConfig) -> tuple[list[EnvConfig], bool]:
    """Eval entries (explicit, or each train env on its eval split) and whether they are new servers.
    A train env can serve eval only if its taskset config has a `split` field."""
    assert cfg.eval is not None
    if cfg.eval.env:
        return list(cfg.eval.env), True
    out = []
    for env in cfg.train.env:
        fields = type(verifiers_env_config(env).taskset).model_fields
        if "split" not in fields:
            raise ValueError(
                f"env {env.name!r} (id {env.id!r}): its taskset config has no `split` field, so eval cannot draw "
                "held-out tasks from it; add [[orchestrator.eval.env]] entries, or set orchestrator.eval.interval = 0"
            )
        args = {**env.args, "split": "eval"} | ({"num_tasks": cfg.eval.num_tasks} if "num_tasks" in fields else {})
        out.append(env.model_copy(update={"args": args}))
    return out, False


def check_envs(cfg: OrchestratorConfig) -> None:
    """Load every env the run uses in this process (its module, taskset and each seat's harness)
    and raise a ValueError naming the env, so a broken env fails in seconds, before the engine
    warms up and env servers spawn."""
    from verifiers.v1 import AgentConfig
    from verifiers.v1.utils.loaders import default_harness_id, harness_class

    configs = list(cfg.train.env) + (eval_env_configs(cfg)[0] if eval_enabled(cfg) else [])
    for config in configs:
        try:
            server = EnvServer(config)  # imports the module, validates its args (spawns nothing)
            if not any(True for _ in server.taskset()):
                raise ValueError("its taskset loaded no tasks")
            for seat in (v for v in vars(server.vf_config).values() if isinstance(v, AgentConfig)):
                harness_class(seat.harness.id if seat.harness else default_harness_id(server.vf_config.taskset.id))
        except Exception as e:  # noqa: BLE001 - whatever the env's own code raises, said in one line
            first = (str(e).strip().splitlines() or [""])[0]
            message = first if first.startswith(f"env {config.name!r}") else f"env {config.name!r} (id {config.id!r}): {first}"
            raise ValueError(f"{message} ({type(e).__name__}; the env must load before the run starts)") from e


class Orchestrator:
    def __init__(
        self,
        cfg: OrchestratorConfig,
        endpoint: ModelEndpoint,
        *,
        output_dir: str | Path,
        seed: int,
        policy_version: Callable[[], int],
        token_versions: Callable[[str], list[list[int]] | None] | None = None,
    ):
        self.cfg = cfg
        self.endpoint = endpoint
        self.output_dir = Path(output_dir)
        self.seed = seed
        self.policy_version = policy_version
        self.token_versions = token_versions
        """Per trace id, the engine's per-token versions of its answers (``attach_token_versions``);
        None: every token carries its rollout's dispatch version."""
        self.groups_per_step = cfg.batch_size // cfg.group_size
        self.algorithms: dict[str, Algorithm] = {e.name: make_algorithm(e.algo) for e in cfg.train.env}
        self.group_sizes = {e.name: e.group_size or cfg.group_size for e in cfg.train.env}
        self.train_sampling = {e.name: sampling_params(cfg.train.sampling_for(e)) for e in cfg.train.env}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="jaxrl-orchestrator", daemon=True)
        self._cond = threading.Condition()
        self._queues: dict[int, _StepQueue] = defaultdict(_StepQueue)
        self._next_step = 1
        self._sampler_at_step: dict[int, dict[str, Any]] = {}
        self._stopping = False
        self._producer: asyncio.Future | None = None
        self._fatal: EnvServerDead | None = None
        self.train_servers: list[EnvServer] = []
        self.eval_servers: list[EnvServer] = []
        self.eval_tasks: dict[str, list[dict[str, Any]]] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self, *, first_step: int = 1, sampler_state: dict[str, Any] | None = None) -> None:
        """Start env servers, load tasks, and begin producing groups for ``first_step`` on."""
        self._thread.start()
        self.train_servers = self._run(start_env_servers(self.cfg.train.env, output_dir=self.output_dir, kind="train"))
        tasks = {s.name: [task_data(t) for t in s.taskset()] for s in self.train_servers}
        self.sampler = TaskSampler(tasks, self.seed, {e.name: e.ratio for e in self.cfg.train.env})
        if sampler_state:
            self.sampler.load_state_dict(sampler_state)
        if eval_enabled(self.cfg):  # no eval servers, tasks or split for a run that never evaluates
            assert self.cfg.eval is not None
            self._start_eval(self.cfg.eval)
        self._next_step = first_step
        self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self._loop)

    def start_eval_only(self) -> None:
        """Only the eval envs' servers and tasks, no train producer (``python -m jaxrl.eval``)."""
        assert self.cfg.eval is not None
        self._thread.start()
        configs, _ = eval_env_configs(self.cfg)
        self.eval_servers = self._run(start_env_servers(configs, output_dir=self.output_dir, kind="eval"))
        self._load_eval_tasks(self.cfg.eval, configs)

    def _start_eval(self, cfg: EvalConfig) -> None:
        configs, separate = eval_env_configs(self.cfg)
        if separate:
            self.eval_servers = self._run(start_env_servers(configs, output_dir=self.output_dir, kind="eval"))
        else:  # same env, eval split: the train servers run any task of their taskset
            by_name = {s.name: s for s in self.train_servers}
            self.eval_servers = [by_name[c.name] for c in configs]
        self._load_eval_tasks(cfg, configs)

    def _load_eval_tasks(self, cfg: EvalConfig, configs: list[EnvConfig]) -> None:
        for server, config in zip(self.eval_servers, configs):
            loader = EnvServer(config, output_dir=self.output_dir, kind="eval")  # loads tasks; spawns nothing
            self.eval_tasks[server.name] = [task_data(t) for t in loader.taskset()][: cfg.num_tasks]

    def close(self) -> None:
        """Cancel in-flight work and stop every env server."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._producer is not None:
            self._producer.cancel()
        if self._thread.is_alive():
            servers = {id(s): s for s in [*self.train_servers, *self.eval_servers]}.values()

            async def shutdown() -> None:
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                await asyncio.gather(*(s.aclose() for s in servers), return_exceptions=True)

            try:
                self._run(shutdown(), timeout=120)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)

    # -- production ------------------------------------------------------------------------
    async def _produce(self) -> None:
        sem = asyncio.Semaphore(max(1, self.cfg.max_concurrent_rollouts // self.cfg.group_size))
        while not self._stopping:
            step = self._next_step
            oldest_allowed = step - 1 - self.cfg.max_async_level
            while self.policy_version() < oldest_allowed and not self._stopping and self._next_step == step:
                await asyncio.sleep(0.02)
            with self._cond:
                if self._next_step != step:  # request_more rewound production to a resampled step
                    continue
                queue = self._queues[step]
                if queue.dispatched >= self.groups_per_step:
                    self._next_step += 1
                    continue
                self._sampler_at_step.setdefault(step, self.sampler.state_dict())
                queue.dispatched += 1
            await sem.acquire()
            draw = self.sampler.turn
            env, data = self.sampler.next()
            task = asyncio.ensure_future(self._group(step, env, data, draw))
            task.add_done_callback(lambda _: sem.release())

    async def _group(self, step: int, env: str, data: dict[str, Any], draw: int) -> None:
        server = next(s for s in self.train_servers if s.name == env)
        version = self.policy_version()
        n = self.group_sizes[env]
        t0 = time.perf_counter()
        try:
            rollouts = await server.run_group(
                data, self.endpoint, self.train_sampling[env], n, policy_version=version,
                seeds=rollout_seeds(self.seed, "train", draw, n=n),
            )
        except EnvServerDead as e:  # surfaces in next_batch: the run checkpoints and stops
            with self._cond:
                self._fatal = self._fatal or e
                self._cond.notify_all()
            return
        if self.token_versions is not None:
            for rollout in rollouts:
                attach_token_versions(rollout, self.token_versions)
        group = Group(env, step, rollouts, version, time.perf_counter() - t0)
        with self._cond:
            self._queues[step].groups.append(group)
            self._cond.notify_all()

    def request_more(self, step: int, n: int | None = None) -> None:
        """Dispatch ``n`` more groups for ``step`` (default: a full batch, a resample; fewer: a
        dynamic-sampling refill)."""
        with self._cond:
            self._queues[step].dispatched -= self.groups_per_step if n is None else n
            self._next_step = min(self._next_step, step)

    def next_batch(self, step: int, timeout: float | None = None, *, n: int | None = None) -> list[Group]:
        """Block until ``n`` (default ``groups_per_step``) groups for ``step`` are done; returns
        and removes them."""
        want = self.groups_per_step if n is None else n
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._queues[step].groups) < want:
                if self._fatal is not None:
                    raise self._fatal
                if self._producer is not None and self._producer.done() and not self._producer.cancelled():
                    self._producer.result()  # re-raise a producer crash here
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no batch for step {step} after {timeout}s")
                self._cond.wait(timeout=1.0 if left is None else min(left, 1.0))
            queue = self._queues[step]
            groups, queue.groups = queue.groups[:want], queue.groups[want:]
            return groups

    def env_logs(self) -> dict[str, Path]:
        """Each train env's server log (where a failed rollout's details are)."""
        return {s.name: s.log_path for s in self.train_servers}

    def sampler_state_for(self, step: int) -> dict[str, Any]:
        """Task-sampler state from which step ``step``'s groups were (or will be) drawn."""
        with self._cond:
            return self._sampler_at_step.get(step) or self.sampler.state_dict()

    # -- evaluation ------------------------------------------------------------------------
    def evaluate(self) -> tuple[dict[str, float], list[Rollout]]:
        """avg@k and pass@k per eval env on its held-out tasks, with the current weights."""
        assert self.cfg.eval is not None
        return self._run(self._evaluate(self.cfg.eval))

    async def _evaluate(self, cfg: EvalConfig) -> tuple[dict[str, float], list[Rollout]]:
        configs = {c.name: c for c in eval_env_configs(self.cfg)[0]}
        version = self.policy_version()
        metrics: dict[str, float] = {}
        everything: list[Rollout] = []
        for server in self.eval_servers:
            tasks = self.eval_tasks[server.name]
            params = sampling_params(cfg.sampling_for(configs[server.name]))
            groups = await asyncio.gather(
                *(
                    server.run_group(
                        t, self.endpoint, params, cfg.k, policy_version=version,
                        seeds=rollout_seeds(self.seed, "eval", server.name, i, n=cfg.k),
                    )
                    for i, t in enumerate(tasks)
                )
            )
            ok = [[r for r in g if r.ok] for g in groups]
            rewards = [r.reward for g in ok for r in g]
            name = server.name
            metrics[f"eval/{name}/avg@{cfg.k}"] = sum(rewards) / len(rewards) if rewards else math.nan
            task_means = [sum(r.reward for r in g) / len(g) for g in ok if g]  # tasks are the independent draws
            metrics[f"eval/{name}/avg@{cfg.k}_se"] = (
                statistics.stdev(task_means) / len(task_means) ** 0.5 if len(task_means) > 1 else math.nan
            )
            metrics[f"eval/{name}/pass@{cfg.k}"] = sum(
                any(r.reward >= cfg.pass_threshold for r in g) for g in ok
            ) / max(len(ok), 1)
            metrics[f"eval/{name}/failed"] = sum(not r.ok for g in groups for r in g)
            everything += [r for g in groups for r in g]
        means = [v for k, v in metrics.items() if "/avg@" in k and not k.endswith("_se") and not math.isnan(v)]
        ses = [v for k, v in metrics.items() if "/avg@" in k and k.endswith("_se")]
        metrics["eval/reward_mean"] = sum(means) / len(means) if means else math.nan
        # standard error of that mean over envs (independent task draws per env)
        metrics["eval/reward_se"] = math.sqrt(sum(s * s for s in ses)) / len(ses) if ses else math.nan
        return metrics, everything
