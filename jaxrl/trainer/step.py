"""The train step: packed micro-batches -> exact accumulated gradients -> one optax update.

Component token counts are totalled on the host for the whole optimizer step before any
forward pass (they depend only on the batch), so each micro-batch's loss is already divided by
the *global* counts and summing micro-batch gradients is exact (DESIGN contract 3). The
micro-step is jitted once per row-length bucket with the gradient accumulator donated; the
update is jitted once with parameters and optimizer state donated.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.arch import ModelArch
from jaxrl.models.decoder import Decoder, LayerAdapters, MoeAux
from jaxrl.models.sharding import state_shardings
from jaxrl.parallel.mesh import batch_sharding, replicated
from jaxrl.parallel.rules import check_expert_parallel
from jaxrl.trainer import lora
from jaxrl.trainer import loss as L
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.logprobs import token_logprobs
from jaxrl.trainer.moe_routing import check_routing, moe_metrics, moe_sums
from jaxrl.trainer.optim import make_optimizer
from jaxrl.trainer.packing import PackedBatch, choose_bucket, component_counts, pack
from jaxrl.training_sample import TrainingSample

# Arrays of a micro-batch the loss reads, in PackedBatch field names, and their dtypes.
_MB_DTYPES = {
    "tokens": jnp.int32,
    "positions": jnp.int32,
    "segment_ids": jnp.int32,
    "loss_mask": jnp.bool_,
    "logq": jnp.float32,
    "advantages": jnp.float32,
    "temperature": jnp.float32,
    "rl_w": jnp.float32,
    "ce_w": jnp.float32,
    "ref_kl_w": jnp.float32,
    "logr": jnp.float32,
    "policy_version": jnp.int32,
}
_MB_FIELDS = tuple(_MB_DTYPES)
_ADD_SUMS = jax.jit(L.add_sums)  # eval_loss: micro-batch sums added in one program
_SUMS_METRICS = jax.jit(L.metrics)
STEP_CONSTANTS = (*L.COMPONENTS, "rl_norm", "trainer_version")
"""What the host computes once per optimizer step and every micro-step reads (``component_counts``
with the loss config): the global component counts, the RL denominator, the trained version."""


def packed_logprobs(
    model: Decoder,
    mb: dict[str, jax.Array],
    kernels: Kernels,
    vocab_block: int,
    lora: LayerAdapters | None = None,
    *,
    replay: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(log-prob, entropy) of every token of packed rows at its temperature, ``[B, T - 1]``:
    entry t - 1 is token t predicted from position t - 1 (column 0 has no prediction).
    ``replay``: route with ``mb["routing"]`` where the batch has it (``routed_forward``)."""
    return _scored(model, mb, kernels, vocab_block, lora, replay)[:2]


def routed_forward(
    model: Decoder, mb: dict[str, jax.Array], kernels: Kernels, lora: LayerAdapters | None, replay: bool
) -> tuple[jax.Array, MoeAux | None]:
    """The training forward of packed rows: hidden states, and for an MoE model its ``MoeAux``.
    ``replay`` with a ``routing`` in ``mb``: each token uses the engine's experts (padding's -1
    entries become experts 0..k-1; their outputs are in no loss)."""
    if not model.arch.is_moe:
        hidden, _ = model(mb["tokens"], mb["positions"], mb["segment_ids"], kernels=kernels, lora=lora)
        return hidden, None
    routing = mb.get("routing") if replay else None
    if routing is not None:
        routing = jnp.where(routing >= 0, routing, jnp.arange(routing.shape[-1], dtype=routing.dtype))
    hidden, _, aux = model(
        mb["tokens"], mb["positions"], mb["segment_ids"], kernels=kernels, lora=lora, routing=routing, with_moe_aux=True
    )
    return hidden, aux


def _scored(model, mb, kernels, vocab_block, lora, replay):  # type: ignore[no-untyped-def]
    """``packed_logprobs`` plus the forward's ``MoeAux`` (None for a dense model)."""
    hidden, aux = routed_forward(model, mb, kernels, lora, replay)
    b, t, d = hidden.shape
    if kernels.context_parallel:
        # Every position is scored against the next token (the last against the row's first,
        # then dropped): slicing ``hidden[:, :-1]`` would make the sequence shards uneven and
        # cost a reshard of the hidden states; a roll of the int targets is a cheap shift.
        hidden, targets, temperature = hidden, jnp.roll(mb["tokens"], -1, 1), jnp.roll(mb["temperature"], -1, 1)
    else:  # the same values; kept so that runs without context parallelism repeat bit for bit
        hidden, targets, temperature = hidden[:, :-1], mb["tokens"][:, 1:], mb["temperature"][:, 1:]
    n = hidden.shape[1]
    logp, entropy = (kernels.token_logprobs() or token_logprobs)(
        hidden.reshape(-1, d),
        model.lm_head_weight(),
        targets.reshape(-1),
        temperature.reshape(-1),
        block_size=vocab_block,
    )
    return logp.reshape(b, n)[:, : t - 1], entropy.reshape(b, n)[:, : t - 1], aux


def micro_batch_loss(
    params: Any,
    graphdef: nnx.GraphDef,
    mb: dict[str, jax.Array],
    counts: dict[str, jax.Array],
    cfg: TrainerConfig,
    kernels: Kernels | None = None,
    frozen: nnx.State | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Loss of one micro-batch, normalised by the step's global counts, and its sums.

    ``counts``: the step's constants (``STEP_CONSTANTS``; at least the component counts).
    ``params``: the trained state - the model's parameters, or with ``[trainer.lora]`` the
    adapters, merged here into the ``frozen`` base weights (so gradients reach only them).
    ``kernels``: log-prob and attention implementations (default: ``cfg.kernels`` resolved for
    JAX's default backend, with Pallas calls unsharded; the ``Trainer`` passes its mesh).
    """
    if kernels is None:
        kernels = Kernels.create(cfg.kernels, field="trainer.kernels")
    adapters = None
    if frozen is not None:  # merged layer by layer inside the decoder's scan
        assert cfg.lora is not None
        params, adapters = frozen, LayerAdapters(params, cfg.lora.scale)
    model = nnx.merge(graphdef, params)
    logp, entropy, aux = _scored(model, mb, kernels, cfg.vocab_block, adapters, cfg.moe_routing != "recompute")
    version = counts.get("trainer_version")
    sums = L.loss_sums(
        logp,
        mb["logq"][:, 1:],
        mb["advantages"][:, 1:],
        mb["rl_w"][:, 1:],
        mb["ce_w"][:, 1:],
        mb["loss_mask"][:, 1:],
        cfg.loss,
        entropy=entropy,
        ref_kl_w=mb["ref_kl_w"][:, 1:],
        logr=mb["logr"][:, 1:],
        segment_ids=mb["segment_ids"][:, 1:],
        positions=mb["positions"][:, 1:],
        policy_version=mb["policy_version"][:, 1:] if "policy_version" in mb else None,
        trainer_version=None if version is None else version.astype(jnp.int32),
    )
    loss = L.normalized_loss(sums, counts)
    if aux is not None:
        sums |= moe_sums(aux, mb["segment_ids"], mb.get("routing"))
        if cfg.moe_aux_loss_coef:  # per micro-batch, as transformers adds it per forward
            loss = loss + cfg.moe_aux_loss_coef * aux.load_balance_loss
    return loss, sums


def _micro_step_impl(params, grad_acc, sums_acc, mb, counts, frozen=None, *, graphdef, cfg, kernels):  # type: ignore[no-untyped-def]
    grad_fn = jax.grad(micro_batch_loss, has_aux=True)  # w.r.t. the trained state only
    grads, sums = grad_fn(params, graphdef, mb, counts, cfg, kernels, frozen)
    return jax.tree.map(jnp.add, grad_acc, grads), L.add_sums(sums_acc, sums)


def _apply_impl(params, opt_state, grads, total, *, tx):  # type: ignore[no-untyped-def]
    """The update, and the step's metrics from its summed micro-batch sums: reduced here, in
    the compiled program, because ~30 eager scalar ops per micro-batch cost seconds per
    step on a busy CPU host (measured: 3-4 s of a 4 s SFT step)."""
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics = L.metrics(total) | moe_metrics(total) | {"grad_norm": optax.tree.norm(grads)}
    return optax.apply_updates(params, updates), opt_state, metrics


def micro_batch_shapes(mesh: Mesh, rows: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract micro-batch (the arrays ``micro_batch_loss`` reads), sharded as the trainer
    feeds it: rows over (data, fsdp)."""
    sharding = batch_sharding(mesh)
    return {
        k: jax.ShapeDtypeStruct((rows, seq_len), _MB_DTYPES[k], sharding=sharding) for k in _MB_FIELDS
    }


def check_context_parallel(arch: ModelArch, cfg: TrainerConfig, mesh: Mesh) -> None:
    """Context parallelism's shape rules, as one line naming trainer.mesh.context: every bucket
    splits evenly over the context axis, and Ulysses attention hands each context device whole
    query heads of its tensor shard (KV heads are repeated up to a multiple where they do not
    divide; see ``jaxrl.kernel_dispatch``)."""
    c = mesh.shape.get("context", 1)
    if c == 1:
        return
    uneven = [b for b in cfg.seq_len_buckets or [cfg.seq_len] if b % c]
    if uneven:
        raise ValueError(
            f"trainer.mesh.context = {c}: trainer.seq_len_buckets {uneven} do not divide by it; "
            "use lengths that are multiples of the context size"
        )
    tensor = mesh.shape.get("tensor", 1)
    heads = arch.num_heads // tensor if arch.num_heads % tensor == 0 and arch.num_kv_heads % tensor == 0 else arch.num_heads
    if heads % c:
        raise ValueError(
            f"trainer.mesh.context = {c}: the model's {heads} query heads per tensor shard do not divide by it "
            "(Ulysses attention splits heads over the context axis); pick a context size that divides them"
        )


@dataclass(frozen=True)
class TrainPrograms:
    """The trainer's jitted programs and the shardings of the state they run on.

    Built from a model whose parameters may be abstract (``nnx.eval_shape``): the trainer
    builds it from real weights, ``jaxrl.aot`` from shapes only, and both compile the same
    programs. The micro-step is jitted once per row-length bucket (by its input shapes) with
    the gradient accumulator donated; the update once, with parameters and optimizer state
    donated. Outputs are pinned to the inputs' shardings: left to the compiler, parameters and
    optimizer state drift to other layouts after an update (recompiling the next step).
    """

    graphdef: nnx.GraphDef
    kernels: Kernels
    param_shardings: Any  # of the trained state: the parameters, or the LoRA adapters
    opt_shardings: Any
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    micro_step: Any
    apply: Any

    @classmethod
    def build(cls, model: Decoder, cfg: TrainerConfig, mesh: Mesh) -> TrainPrograms:
        """Programs for ``model`` on ``mesh``; sets ``model.remat`` from ``cfg.remat`` (resolved for
        the mesh's platform)."""
        dp = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape.get("expert", 1)
        if cfg.micro_batch_rows % dp:
            raise ValueError(
                f"trainer.micro_batch_rows = {cfg.micro_batch_rows} must be a multiple of "
                f"data*fsdp*expert = {dp} (each data-parallel shard gets whole rows)"
            )
        check_expert_parallel(getattr(model.arch, "num_experts", 0), mesh.shape.get("expert", 1), field="trainer.mesh.expert")
        check_context_parallel(model.arch, cfg, mesh)
        if cfg.moe_routing == "replay" and not model.arch.is_moe:
            raise ValueError('trainer.moe_routing = "replay" needs a mixture-of-experts model; this one is dense')
        platform = mesh.devices.flat[0].platform
        model.remat = cfg.remat_policy(platform)
        kernels = Kernels.create(cfg.kernels, field="trainer.kernels", mesh=mesh)
        graphdef, params = nnx.split(model)
        if cfg.lora is not None:  # the optimizer sees the adapters alone
            param_shardings = lora.adapter_shardings(params, cfg.lora, mesh)
            params = jax.eval_shape(lambda: lora.init_adapters(params, cfg.lora, mesh))
        else:
            param_shardings = state_shardings(params, mesh)
        tx, schedule = make_optimizer(cfg.optim, cfg.steps)
        # Moments are sharded as their parameters (fsdp: never a full copy per chip); the
        # step counts and other scalars are replicated explicitly: left uncommitted they would
        # restore from a checkpoint onto a single device.
        abstract_opt = jax.eval_shape(tx.init, params)
        opt_shardings = optax.tree_map_params(
            tx, lambda _, sh: sh, abstract_opt, param_shardings, transform_non_params=lambda _: replicated(mesh)
        )
        micro_step = jax.jit(
            partial(_micro_step_impl, graphdef=graphdef, cfg=cfg, kernels=kernels),
            donate_argnums=(1, 2),
            out_shardings=(param_shardings, replicated(mesh)),
        )
        apply = jax.jit(
            partial(_apply_impl, tx=tx),
            donate_argnums=(0, 1),  # the gradients have no output to alias: donating them only warns
            out_shardings=(param_shardings, opt_shardings, replicated(mesh)),
        )
        return cls(graphdef, kernels, param_shardings, opt_shardings, tx, schedule, micro_step, apply)

    def abstract_state(self, params: Any) -> tuple[Any, Any]:
        """(parameters, optimizer state) as sharded ``ShapeDtypeStruct``s (nothing allocated)."""
        p = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params, self.param_shardings)
        opt = jax.eval_shape(self.tx.init, params)
        o = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), opt, self.opt_shardings)
        return p, o

    def sums_shapes(
        self, params: Any, mb: dict[str, Any], cfg: TrainerConfig, frozen: Any = None
    ) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes of the micro-step's loss-sum accumulator (traced, not run)."""
        counts = {c: jax.ShapeDtypeStruct((), jnp.float32) for c in STEP_CONSTANTS}
        return jax.eval_shape(
            lambda p, m, c, f: micro_batch_loss(p, self.graphdef, m, c, cfg, self.kernels, f)[1], params, mb, counts, frozen
        )


class Trainer:
    """Owns parameters and optimizer state on the mesh and runs optimizer steps on samples."""

    def __init__(self, model: Decoder, cfg: TrainerConfig, mesh: Mesh, *, peak_flops: float | None = None):
        self.cfg = cfg
        self.mesh = mesh
        self.arch = model.arch
        self.programs = TrainPrograms.build(model, cfg, mesh)
        self.kernels = self.programs.kernels
        self.graphdef, params = self.programs.graphdef, nnx.state(model)
        # The trained state: the parameters, or with [trainer.lora] the adapters on a frozen base.
        self.frozen: nnx.State | None = None
        self.trainable: Any = params
        self._merge: Any = None
        if cfg.lora is not None:
            self.frozen, self.trainable = params, lora.init_adapters(params, cfg.lora, mesh)
            self._merge = jax.jit(partial(lora.merged, scale=cfg.lora.scale), out_shardings=state_shardings(params, mesh))
        self.param_shardings = self.programs.param_shardings
        self.tx, self.schedule = self.programs.tx, self.programs.schedule
        self.opt_state = jax.jit(self.tx.init, out_shardings=self.programs.opt_shardings)(self.trainable)
        self.step = 0
        self.peak_flops = peak_flops
        self._micro_step, self._apply = self.programs.micro_step, self.programs.apply
        self._zeros: Any = None  # compiled on first use: makes the zeroed accumulators
        self._loss_sums: Any = None  # compiled on first eval: a micro-batch's loss sums, no gradient

    # -- host side -------------------------------------------------------------------------
    def _device_batch(self, batch: PackedBatch) -> dict[str, jax.Array]:
        """Global arrays sharded by rows; each process supplies only its addressable shards."""
        return {
            k: jax.make_array_from_callback(v.shape, batch_sharding(self.mesh, v.ndim), lambda idx, v=v: v[idx])
            for k, v in batch.as_dict().items()
            if k in _MB_FIELDS or (k == "routing" and self.arch.is_moe)
        }

    def pack(self, samples: Sequence[TrainingSample]) -> PackedBatch:
        self._check_routing(samples)
        bucket = choose_bucket(samples, self.cfg.seq_len_buckets or [self.cfg.seq_len], self.cfg.micro_batch_rows)
        return pack(samples, bucket, rows_multiple=self.cfg.micro_batch_rows)

    def _check_routing(self, samples: Sequence[TrainingSample]) -> None:
        """Samples' ``routed_experts`` fit this model; under replay, every sample with RL tokens
        carries them once any does (a forward cannot route some tokens by replay and others by
        the router), and on a dense model none does."""
        arch = self.arch
        routed = [s for s in samples if s.routed_experts is not None]
        if routed and not arch.is_moe:
            raise ValueError("samples carry routed_experts but the trained model is dense: they come from another model")
        for s in routed:
            check_routing(s.routed_experts, len(arch.moe_layers), arch.num_experts_per_tok, arch.num_experts, "sample")
        if self.cfg.moe_routing != "recompute":
            missing = sum(1 for s in samples if s.routed_experts is None and bool(s.rl_w[1:].any()))
            if missing and (routed or self.cfg.moe_routing == "replay"):
                raise ValueError(
                    f"{missing} of {len(samples)} RL samples carry no routed_experts under trainer.moe_routing = "
                    '"replay": their rollout backend did not return routing; set trainer.moe_routing = "recompute"'
                )

    def _step_constants(self, batch: PackedBatch) -> dict[str, jax.Array]:
        """``STEP_CONSTANTS`` of ``batch``, replicated: counts after the staleness rule, the RL
        denominator, and the version being trained (the parameters' step count)."""
        constants = component_counts(batch, self.cfg.loss, trainer_version=self.step)
        return jax.device_put({k: np.float32(constants[k]) for k in STEP_CONSTANTS}, replicated(self.mesh))

    def train_step(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        """One optimizer step over ``samples``; returns this step's metrics (host floats)."""
        t0 = time.perf_counter()
        batch = self.pack(samples)
        if unscored := sum(s.needs_reference for s in samples):
            raise ValueError(f"{unscored} sample(s) train the ref-KL component but carry no teacher log-probs (logr)")
        counts = self._step_constants(batch)
        grads, total = self._zeroed_accumulators(batch)
        rows = self.cfg.micro_batch_rows
        for start in range(0, batch.num_rows, rows):
            mb = self._device_batch(batch.rows(start, start + rows))
            grads, total = self._micro_step(self.trainable, grads, total, mb, counts, self.frozen)
        lr = float(self.schedule(self.step))
        self.trainable, self.opt_state, metrics = self._apply(self.trainable, self.opt_state, grads, total)
        self.step += 1
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        elapsed = time.perf_counter() - t0
        tokens = float(np.sum(batch.segment_ids > 0))
        out |= {
            "lr": lr,
            "tokens": tokens,
            "padding_frac": 1.0 - tokens / batch.tokens.size,
            "time/train_s": elapsed,  # this optimizer step (pack, forward/backward, update); RL adds time/step_s
            "tokens_per_s": tokens / elapsed,
        }
        if self.peak_flops:
            flops = self.arch.flops_per_token(batch.tokens.shape[1]) * tokens
            out["mfu"] = flops / elapsed / (self.peak_flops * self.mesh.size)
        return out

    def eval_loss(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        """CE loss (NLL per loss-masked token) and token count of ``samples`` under the current
        parameters, with no update: packed and split into micro-batches as ``train_step`` does,
        forward only (one extra compile per row-length bucket)."""
        batch = self.pack(samples)
        counts = self._step_constants(batch)
        if self._loss_sums is None:
            self._loss_sums = jax.jit(
                lambda params, mb, counts, frozen: micro_batch_loss(
                    params, self.graphdef, mb, counts, self.cfg, self.kernels, frozen
                )[1],
                out_shardings=replicated(self.mesh),
            )
        # Sums are added and turned into metrics by compiled programs, one per micro-batch, never
        # key by key in eager jax: a few dozen eager ops on mesh-wide arrays, dispatched ahead,
        # fill XLA:CPU's per-device limit of in-flight programs (32) while the devices of one
        # collective wait on each other, and the process aborts (a sharded eval did, in CI).
        total = None
        rows = self.cfg.micro_batch_rows
        for start in range(0, batch.num_rows, rows):
            sums = self._loss_sums(self.trainable, self._device_batch(batch.rows(start, start + rows)), counts, self.frozen)
            total = sums if total is None else _ADD_SUMS(total, sums)
        metrics = jax.device_get(_SUMS_METRICS(total))
        return {"ce_loss": float(metrics["ce_loss"]), "ce_tokens": float(metrics["ce_tokens"])}

    def _zeroed_accumulators(self, batch: PackedBatch) -> tuple[nnx.State, dict[str, jax.Array]]:
        """Zeroed gradient and loss-sum accumulators, made by one compiled program (0 is also
        right for the ``*_max`` sums: NLLs are >= 0). The sums' structure is traced once."""
        if self._zeros is None:
            sums = self.programs.sums_shapes(self.trainable, micro_batch_shapes(self.mesh, self.cfg.micro_batch_rows, batch.tokens.shape[1]), self.cfg, self.frozen)
            self._zeros = jax.jit(
                lambda params: (jax.tree.map(jnp.zeros_like, params), {k: jnp.zeros(v.shape, v.dtype) for k, v in sums.items()}),
                out_shardings=(self.param_shardings, replicated(self.mesh)),
            )
        return self._zeros(self.trainable)

    def model(self) -> Decoder:
        """A Decoder view of the current parameters (shares the arrays; no copy)."""
        return nnx.merge(self.graphdef, self.params)

    @property
    def params(self) -> nnx.State:
        """The policy's full parameters: what rollout backends serve and ``export_hf`` writes
        (with ``[trainer.lora]`` the base merged with the adapters, a new sharded state)."""
        return self.trainable if self._merge is None else self._merge(self.frozen, self.trainable)

    def state_for_checkpoint(self) -> dict[str, Any]:
        """What a checkpoint holds: the trained state (the adapters alone with LoRA: the frozen
        base is the model the run starts from) and the optimizer state."""
        return {"params": self.trainable, "opt_state": self.opt_state}

    def restore(self, state: dict[str, Any], step: int) -> None:
        self.trainable, self.opt_state, self.step = state["params"], state["opt_state"], step
