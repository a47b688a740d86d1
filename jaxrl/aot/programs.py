"""The run's device programs, compiled from abstract shapes for a topology, and whether they fit.

What is compiled is what the run executes, built by the run's own code: the trainer's
``TrainPrograms`` (the micro-step once per ``trainer.seq_len_buckets`` entry, and the update)
and, for RL configs with the embedded engine, ``engine_programs`` at the largest decode and
prefill buckets (``max_seqs`` rows x ``max_model_len`` positions; smaller buckets need less),
on the mesh the run gives the engine: ``weights.serving_mesh`` (its first tensor x expert
devices) on a single-host topology, ``weights.colocated_mesh`` (every device: replica x expert x
tensor, weights and KV cache repeated over the replica groups) on a multi-host one, where the engine runs
colocated over every trainer process (``jaxrl.rollout.colocated``).
Model and optimizer state are ``nnx.eval_shape`` / ``jax.eval_shape`` shapes with the run's
shardings, so nothing is allocated.

Per chip, a program needs its compiled footprint (arguments + outputs not aliased to donated
arguments + temporaries, from ``memory_analysis``) plus whatever else stays resident while it
runs: the optimizer state during the micro-step; the engine's weights and KV cache during
training steps (the embedded engine shares the trainer's chips); the trainer's parameters and
optimizer state during rollouts. That total is compared with the chip's HBM.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.aot.topology import Topology
from jaxrl.config import ModelConfig, RunConfig
from jaxrl.models.arch import ModelArch, arch_from_hf_config
from jaxrl.models.decoder import Decoder
from jaxrl.models.presets import PRESETS, preset_hf_config
from jaxrl.models.setup import DTYPES, padded_vocab, scratch_hf_config
from jaxrl.parallel.mesh import make_mesh, replicated
from jaxrl.trainer.step import STEP_CONSTANTS, TrainPrograms, micro_batch_shapes

TRAINER_KNOBS = (
    "trainer.mesh (fsdp/tensor shard parameters, optimizer state and activations)",
    "trainer.micro_batch_rows (activations grow with rows x seq_len)",
    'trainer.remat ("full" keeps only each layer\'s input)',
    "trainer.seq_len / seq_len_buckets",
)
ENGINE_KNOBS = (
    "inference.max_seqs and inference.max_model_len (KV cache = max_seqs x max_model_len positions)",
    (
        "inference.backend.tensor_parallel (shards weights and KV cache heads; colocated on a multi-host slice, "
        "each of the devices / (tensor x expert) replica groups holds a whole copy)"
    ),
    'inference.backend.kv_cache_dtype = "bfloat16"',
)


@dataclass
class ProgramFit:
    """One compiled program's per-chip memory (bytes) and whether it fits the chip's HBM."""

    program: str
    topology: str
    mesh: dict[str, int]
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    resident_other_bytes: int = 0  # state outside this program's arguments that stays in HBM
    total_bytes: int = 0
    hbm_bytes: int = 0
    fits: bool = False
    compile_s: float = 0.0
    estimated_flops: float | None = None  # XLA cost model: an estimate (custom calls, scans)
    estimated_bytes_accessed: float | None = None
    error: str | None = None
    oom: bool = False  # XLA itself found the program over HBM (its error says by how much)
    knobs: tuple[str, ...] = field(default_factory=tuple)

    def json(self) -> str:
        return json.dumps(asdict(self))


def model_hf_config(model: ModelConfig) -> tuple[dict[str, Any], str]:
    """(config.json dict, where it came from) for ``[model]``: the directory's config.json, a
    built-in architecture of the checkpoint it names (``jaxrl.models.presets``), or the scratch
    model's config (with jaxrl's byte-level tokenizer's vocabulary). Never loads weights."""
    if model.scratch is not None:
        tok = model.tokenizer
        if tok is None:
            from jaxrl.models.tokenizer import build_tokenizer

            tok = str(build_tokenizer(Path(tempfile.mkdtemp(prefix="jaxrl-aot-tok-"))))
        return scratch_hf_config(model.scratch, vocab_size=padded_vocab(tok)), "[model.scratch]"
    assert model.name is not None
    path = Path(model.name) / "config.json"
    if path.exists():
        return json.loads(path.read_text()), str(path)
    preset = preset_hf_config(model.name)
    if preset is None:
        raise FileNotFoundError(
            f"model.name = {model.name!r}: no config.json there and not a built-in architecture "
            f"({', '.join(PRESETS)}); download the checkpoint's config.json into that directory"
        )
    return preset, f"built-in {model.name.rstrip('/').split('/')[-1]} architecture"


def _per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of an abstract, sharded pytree (the largest shard per leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
    return total


def _compile(fit: ProgramFit, jitted: Any, *args: Any, **kwargs: Any) -> ProgramFit:
    t0 = time.perf_counter()
    try:
        compiled = jitted.lower(*args, **kwargs).compile()
    except Exception as e:  # a compile failure (e.g. a kernel over VMEM) is a result, not a crash
        msg = str(e).strip().splitlines()[0][:400].rstrip(".")
        fit.error = f"{type(e).__name__}: {msg}"
        fit.oom = "RESOURCE_EXHAUSTED" in msg and "HBM" in msg
        fit.compile_s = time.perf_counter() - t0
        return fit
    fit.compile_s = round(time.perf_counter() - t0, 2)
    mem = compiled.memory_analysis()
    fit.argument_bytes = int(mem.argument_size_in_bytes)
    fit.output_bytes = int(mem.output_size_in_bytes)
    fit.alias_bytes = int(mem.alias_size_in_bytes)
    fit.temp_bytes = int(mem.temp_size_in_bytes)
    cost = compiled.cost_analysis() or {}
    cost = cost[0] if isinstance(cost, list) else cost
    fit.estimated_flops = float(cost.get("flops", 0.0)) or None
    fit.estimated_bytes_accessed = float(cost.get("bytes accessed", 0.0)) or None
    return fit


def _finish(fit: ProgramFit, resident_other: int, hbm: int) -> ProgramFit:
    fit.resident_other_bytes = resident_other
    fit.hbm_bytes = hbm
    if fit.error is None:
        peak = fit.argument_bytes + fit.output_bytes - fit.alias_bytes + fit.temp_bytes
        fit.total_bytes = peak + resident_other
        fit.fits = fit.total_bytes <= hbm
    return fit


def _mesh_dict(mesh: Mesh) -> dict[str, int]:
    return {str(k): int(v) for k, v in mesh.shape.items()}


def abstract_decoder(arch: ModelArch, param_dtype: Any, dtype: Any) -> Decoder:
    """The decoder with every weight a ShapeDtypeStruct (nothing allocated)."""
    return nnx.eval_shape(lambda: Decoder(arch, rngs=nnx.Rngs(0), param_dtype=param_dtype, dtype=dtype))


@dataclass
class EngineShapes:
    config: Any  # EngineConfig, max_model_len resolved for the model
    mesh: Mesh
    graphdef: Any
    weights: Any  # sharded ShapeDtypeStructs
    layout: Any  # jaxrl.engine.engine.EngineLayout
    kernels: Any


@dataclass
class RunShapes:
    """A run's state as sharded abstract shapes on a topology (built, never allocated)."""

    topo: Topology
    arch: ModelArch
    mesh: Mesh
    model: Decoder
    programs: TrainPrograms
    params: Any
    """The trained state: the parameters, or with ``[trainer.lora]`` the adapters."""
    opt: Any
    engine: EngineShapes | None
    frozen: Any = None
    """With ``[trainer.lora]``: the frozen base weights (resident, read by every micro-step)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes per chip of each resident state (the engine's on the chips it uses)."""
        out = {"trainer_params": _per_device_bytes(self.params), "trainer_opt_state": _per_device_bytes(self.opt),
               "trainer_frozen": _per_device_bytes(self.frozen) if self.frozen is not None else 0}
        if self.engine is not None:
            out["engine_weights"] = _per_device_bytes(self.engine.weights)
            out["engine_kv_cache"] = _per_device_bytes(self.engine.layout.abstract_cache())
        return out


def run_shapes(
    cfg: RunConfig, topo: Topology, *, engine: bool | None = None, colocated: bool | None = None
) -> RunShapes:
    """The run's abstract state on ``topo``. ``engine``: include the embedded engine (default:
    for RL configs whose ``inference.backend`` is "embedded"); ``colocated``: the engine spans
    every device (default: when ``topo`` has several hosts, as the run does with several
    processes), else it takes the first tensor x expert devices."""
    hf_config, _ = model_hf_config(cfg.model)
    arch = arch_from_hf_config(hf_config)
    param_dtype, dtype = DTYPES[cfg.model.param_dtype], DTYPES[cfg.model.dtype]
    mesh = make_mesh(cfg.trainer.mesh, list(topo.devices))
    model = abstract_decoder(arch, param_dtype, dtype)
    programs = TrainPrograms.build(model, cfg.trainer, mesh)
    state, frozen = nnx.state(model), None
    if (lora_cfg := cfg.trainer.lora) is not None:  # the base is frozen; the optimizer sees the adapters
        from jaxrl.models.sharding import state_shardings
        from jaxrl.trainer import lora

        frozen = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, state_shardings(state, mesh))
        state = jax.eval_shape(lambda: lora.init_adapters(frozen, lora_cfg, mesh))
    params, opt = programs.abstract_state(state)
    with_engine = (cfg.mode == "rl" and cfg.inference.backend.type == "embedded") if engine is None else engine
    colocated = topo.hosts > 1 if colocated is None else colocated
    eng = _engine_shapes(cfg, arch, model, topo, colocated) if with_engine else None
    return RunShapes(topo, arch, mesh, model, programs, params, opt, eng, frozen)


def _engine_shapes(
    cfg: RunConfig, arch: ModelArch, trainer_model: Decoder, topo: Topology, colocated: bool = False
) -> EngineShapes:
    from jaxrl.engine import weights
    from jaxrl.engine.programs import EngineLayout
    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.models.quantize import abstract_quantized, cast_projections

    icfg = cfg.inference.engine_config().with_model_len(arch.max_position_embeddings)  # unset: the model's own context
    if icfg.max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"inference.max_model_len ({icfg.max_model_len}) exceeds the model's max_position_embeddings "
            f"({arch.max_position_embeddings}); lower it"
        )
    if icfg.tensor_parallel * icfg.expert_parallel > topo.num_devices:
        raise ValueError(
            f"inference.backend.tensor_parallel * expert_parallel = {icfg.tensor_parallel * icfg.expert_parallel} "
            f"> {topo.num_devices} devices in {topo.name}"
        )
    if colocated:  # several processes: the run's engine spans them all (jaxrl.rollout.colocated)
        mesh = weights.colocated_mesh(icfg.tensor_parallel, icfg.expert_parallel, list(topo.devices))
    else:  # one process: weights.serving_mesh (None = one device); a 1-device "tensor" mesh places
        # everything the same way on the topology's first chip.
        mesh = weights.serving_mesh(icfg.tensor_parallel, list(topo.devices), icfg.expert_parallel) or Mesh(
            np.array(topo.devices[:1]), ("tensor",)
        )
    graphdef, state = nnx.split(trainer_model)  # the engine serves the trainer's model (jaxrl.rl)
    shardings = weights.state_shardings(state, weights.param_sharding_fn(mesh))
    weights = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, shardings)
    layout = EngineLayout.create(arch, icfg, trainer_model.dtype, mesh)
    kernels = Kernels.create(icfg.kernels, field="inference.backend.kernels", mesh=mesh)
    # The engine serves 8-bit projections when set, else its projections as the kernels store them
    # (ModelRunner._served).
    if icfg.quantization != "none":
        weights = abstract_quantized(weights, icfg.quantization)
    elif (storage := kernels.projection_storage(trainer_model.dtype)) is not None:
        weights = cast_projections(weights, storage)
    return EngineShapes(icfg, mesh, graphdef, weights, layout, kernels)


def plan(
    cfg: RunConfig, topo: Topology, *, engine: bool | None = None, trainer: bool = True, colocated: bool | None = None,
    serve: bool = False,
) -> list[ProgramFit]:
    """Compile the run's programs for ``topo``; one ``ProgramFit`` each (errors included).

    ``engine``: also the embedded engine's programs, ``colocated``: on every device (see
    ``run_shapes``); ``trainer``: the trainer's (False: the engine's alone, with the trainer's
    state still counted resident); ``serve``: the engine's alone with nothing else resident (a
    ``jaxrl.serve`` rollout server's view).
    """
    trainer = trainer and not serve
    run = run_shapes(cfg, topo, engine=engine, colocated=colocated)
    tcfg, mesh, programs, params, opt = cfg.trainer, run.mesh, run.programs, run.params, run.opt
    frozen_args = () if run.frozen is None else (run.frozen,)  # LoRA: the base is the micro-step's last argument
    sb = run.state_bytes()
    engine_state_bytes = sb.get("engine_weights", 0) + sb.get("engine_kv_cache", 0)
    engine_fits = _engine_fits(cfg, run.engine, topo) if run.engine is not None else []

    fits: list[ProgramFit] = []
    counts = {c: jax.ShapeDtypeStruct((), jnp.float32, sharding=replicated(mesh)) for c in STEP_CONSTANTS}
    sums: Any = None
    for bucket in (tcfg.seq_len_buckets or [tcfg.seq_len]) if trainer else []:
        mb = micro_batch_shapes(mesh, tcfg.micro_batch_rows, bucket)
        sums = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated(mesh)),
            programs.sums_shapes(params, mb, tcfg, run.frozen),
        )
        fit = ProgramFit(f"train_micro_step[{tcfg.micro_batch_rows}x{bucket}]", topo.name, _mesh_dict(mesh), knobs=TRAINER_KNOBS)
        _compile(fit, programs.micro_step, params, params, sums, mb, counts, *frozen_args)
        fits.append(_finish(fit, sb["trainer_opt_state"] + engine_state_bytes, topo.hbm_per_device))
    if trainer:
        fit = ProgramFit("train_update", topo.name, _mesh_dict(mesh), knobs=TRAINER_KNOBS[:1])
        _compile(fit, programs.apply, params, opt, params, sums)
        fits.append(_finish(fit, engine_state_bytes + sb["trainer_frozen"], topo.hbm_per_device))
    resident = 0 if serve else sb["trainer_params"] + sb["trainer_frozen"] + sb["trainer_opt_state"]
    for f in engine_fits:  # the trainer's parameters and optimizer state stay resident (unless serving alone)
        fits.append(_finish(f, resident, topo.hbm_per_device))
    return fits


def _engine_fits(cfg: RunConfig, eng: EngineShapes, topo: Topology) -> list[ProgramFit]:
    """The engine's largest decode and prefill programs, compiled (not yet ``_finish``ed)."""
    from jaxrl.engine.programs import engine_programs

    icfg, layout = eng.config, eng.layout
    programs = engine_programs(eng.graphdef, layout, eng.kernels)
    prefill, decode = programs.prefill, programs.decode
    cache, counts = layout.abstract_cache(), layout.abstract_counts()
    md = _mesh_dict(eng.mesh)
    b = icfg.decode_buckets()[-1]
    dfit = ProgramFit(f"engine_decode[{b}x{icfg.max_model_len}]", topo.name, md, knobs=ENGINE_KNOBS)
    steps = icfg.decode_step_counts()[-1]
    _compile(dfit, decode, steps, eng.weights, cache, counts, *layout.decode_inputs(b))
    pb, pn = icfg.prefill_batches()[-1], icfg.prefill_lengths()[-1]
    pfit = ProgramFit(f"engine_prefill[{pb}x{pn}]", topo.name, md, knobs=ENGINE_KNOBS)
    _compile(pfit, prefill, eng.weights, cache, counts, *layout.prefill_inputs(pb, pn))
    return [dfit, pfit]
