"""LoRA on an 8-device (2, 2, 2) mesh: only the adapters train (the base stays bit-identical and
has no optimizer state), the loss falls, adapters are sharded, and the merged export is the
model transformers loads."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
import transformers
from flax import nnx

from jaxrl.models.hf_io import export_hf, load_decoder
from jaxrl.models.sharding import param_sharding_fn
from jaxrl.models.tiny import qwen3_config, save_random_checkpoint
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.lora import TARGETS, LoraConfig
from jaxrl.trainer.step import Trainer
from jaxrl.training_sample import TrainingSample


def _tiny_hf(out_dir) -> dict:
    pytest.importorskip("torch")  # transformers writes the checkpoint
    cfg = qwen3_config(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    save_random_checkpoint(out_dir, cfg, seed=0)
    return json.loads((out_dir / "config.json").read_text())


def _logits(model, tokens: np.ndarray) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    hidden, _ = model(jnp.asarray(tokens), jnp.asarray(positions))
    return np.asarray(model.logits(hidden))


@pytest.mark.slow  # training and a merged export: the slow tier (the adapter checkpoint test stays fast)
def test_lora_trains_only_adapters_and_exports_the_merged_model(tmp_path) -> None:
    torch = pytest.importorskip("torch")  # the reference forward
    hf_config = _tiny_hf(tmp_path / "base")
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    model = load_decoder(tmp_path / "base", sharding_fn=param_sharding_fn(mesh))
    base = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    cfg = TrainerConfig(seq_len=32, seq_len_buckets=[32], micro_batch_rows=4, steps=20,
                        lora=LoraConfig(rank=4, alpha=8),
                        optim={"lr": 2e-2, "schedule": "constant", "warmup_steps": 0})  # fmt: skip
    trainer = Trainer(model, cfg, mesh)

    # Step 0 is the base model exactly (B = 0).
    for want, got in zip(base, jax.tree.leaves(trainer.params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    # The optimizer holds the adapters alone: about 2x their size (Adam), far below the base's.
    n_base = sum(x.size for x in base)
    n_adapters = sum(x.size for x in jax.tree.leaves(trainer.trainable))
    n_opt = sum(x.size for x in jax.tree.leaves(trainer.opt_state))
    assert sorted(trainer.trainable) == sorted(w for w, _ in TARGETS.values())
    assert n_adapters < n_base / 4 and n_opt < 2 * n_adapters + 16, (n_base, n_adapters, n_opt)
    # Adapters are sharded by the weights' rules: wq's A keeps [layers, embed(fsdp), rank].
    a = trainer.trainable["wq"]["a"]
    assert a.shape == (2, 64, 4) and not a.sharding.is_fully_replicated

    rng = np.random.default_rng(0)
    seqs = [np.tile(rng.integers(0, 97, 4), 6) for _ in range(8)]  # learnable repeats
    samples = [TrainingSample.sft(s, np.ones(len(s))) for s in seqs]
    losses = [trainer.train_step(samples)["ce_loss"] for _ in range(20)]
    assert losses[-1] < 0.85 * losses[0], losses  # seen 0.78 (4.57 -> 3.58)

    # The base weights are bit-identical after training; the served/exported weights moved.
    for want, got in zip(base, jax.tree.leaves(trainer.frozen), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    merged = trainer.params
    assert not np.array_equal(np.asarray(merged["wq"][...]), np.asarray(nnx.state(model)["wq"][...]))
    np.testing.assert_array_equal(np.asarray(merged["embed"][...]), np.asarray(nnx.state(model)["embed"][...]))

    # The export is the merged model: transformers gives jaxrl's logits.
    export_hf(trainer.model(), tmp_path / "out", hf_config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = rng.integers(0, 97, size=(2, 16))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    got = _logits(trainer.model(), tokens)
    assert np.abs(got - want).max() <= 1e-4
    assert np.abs(got - _logits(model, tokens)).max() > 1e-3  # and it is not the base model


def test_lora_checkpoint_state_is_the_adapters(tmp_path) -> None:
    """A checkpoint holds the adapters and their optimizer state (the base is the run's model),
    and restoring them gives back the same merged policy."""
    from jaxrl.trainer.checkpoint import Checkpointer, CkptConfig

    _tiny_hf(tmp_path / "base")
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    cfg = TrainerConfig(seq_len=32, seq_len_buckets=[32], micro_batch_rows=4, steps=4,
                        lora=LoraConfig(rank=2, alpha=4, target_modules=["q_proj", "down_proj"]))  # fmt: skip
    cfg.optim.lr = 1e-2
    trainer = Trainer(load_decoder(tmp_path / "base", sharding_fn=param_sharding_fn(mesh)), cfg, mesh)
    samples = [TrainingSample.sft(np.arange(i, i + 20) % 97, np.ones(20)) for i in range(8)]
    trainer.train_step(samples)
    ckpt = Checkpointer(tmp_path / "ckpt", CkptConfig())
    ckpt.save(1, trainer.state_for_checkpoint(), {"step": 1})
    ckpt.wait()
    assert sorted(trainer.state_for_checkpoint()["params"]) == ["w_down", "wq"]
    fresh = Trainer(load_decoder(tmp_path / "base", sharding_fn=param_sharding_fn(mesh)), cfg, mesh)
    state, _ = ckpt.restore(1, fresh.state_for_checkpoint())
    fresh.restore(state, 1)
    for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(fresh.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert fresh.train_step(samples)["ce_loss"] == pytest.approx(trainer.train_step(samples)["ce_loss"], rel=1e-6)


@pytest.mark.parametrize(("over", "needle"), [
    ({"target_modules": ["qkv_proj"]}, "unknown qkv_proj; known: q_proj, k_proj"),
    ({"target_modules": []}, "empty"),
    ({"target_modules": ["q_proj", "q_proj"]}, "twice"),
    ({"rank": 0}, "rank"),
    ({"alpha": float("inf")}, "alpha"),
])  # fmt: skip
def test_lora_config_is_checked(over, needle) -> None:
    with pytest.raises(pydantic.ValidationError, match=needle):
        TrainerConfig(lora=over)


@pytest.mark.slow
def test_lora_rl_serves_the_merged_policy(tmp_path) -> None:
    """Two GRPO steps with LoRA and the embedded engine, on-policy (max_async_level 0): step 2's
    rollouts come from the engine holding base + step 1's adapters, so the trainer's log-probs
    match the sampler's (mismatch KL ~0) only if the merged weights were synced."""
    torch = pytest.importorskip("torch")  # the exported model and adapter load in transformers + PEFT
    peft = pytest.importorskip("peft")
    from families import build_family_model

    from jaxrl.cli import build_config
    from jaxrl.metrics import read_metrics
    from jaxrl.rl import run_rl

    model = build_family_model(tmp_path / "model", "qwen3")
    before = (model / "model.safetensors").read_bytes()
    out = tmp_path / "rl"
    run_rl(build_config({
        "output_dir": str(out), "model": {"name": str(model)},
        "trainer": {"steps": 2, "seq_len": 256, "seq_len_buckets": [256], "micro_batch_rows": 4,
                    "mesh": {"num_devices": 1}, "lora": {"rank": 4, "alpha": 16},
                    "optim": {"lr": 5e-2, "warmup_steps": 0, "schedule": "constant"}},
        "inference": {"server": {"port": 0}, "max_model_len": 256, "max_seqs": 8,
                      "backend": {"type": "embedded", "prefill_len_buckets": [128, 256], "prefill_batch_buckets": [4],
                                  "decode_batch_buckets": [8]}},
        "orchestrator": {"batch_size": 8, "group_size": 4, "max_resample": 3, "max_async_level": 0,
                         "train": {"sampling": {"max_completion_tokens": 8, "temperature": 1.0},
                                   "env": [{"id": "reverse_text", "args": {"seed": 3}}]}},
        "log": {"progress": False, "plot": False},
    }, []))  # fmt: skip
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["train/policy_version"] for r in rows] == [1.0, 2.0]
    assert all(r["train/rl_tokens"] > 0 and r["train/mismatch_kl"] < 1e-5 for r in rows), rows
    assert (model / "model.safetensors").read_bytes() == before  # the base model is never written
    exported = transformers.AutoModelForCausalLM.from_pretrained(out / "hf")
    base = transformers.AutoModelForCausalLM.from_pretrained(model)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(exported.state_dict()[q], base.state_dict()[q])  # merged adapters exported
    e = "model.embed_tokens.weight"
    assert torch.equal(exported.state_dict()[e], base.state_dict()[e])  # not adapted: unchanged
    # The adapters in PEFT format beside it: base + adapter is the merged export.
    assert json.loads((out / "result.json").read_text())["export_adapter"] == str(out / "hf_adapter")
    adapter_config = json.loads((out / "hf_adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(model.resolve())
    tokens = torch.tensor(np.random.default_rng(0).integers(0, 256, size=(2, 16)))
    with torch.no_grad():
        want = exported(tokens).logits
        got = peft.PeftModel.from_pretrained(base, out / "hf_adapter").eval()(tokens).logits
    assert (got - want).abs().max() <= 1e-4


@pytest.mark.slow  # two exports with remat: the slow tier
def test_per_layer_merge_matches_merging_the_whole_model_with_remat(tmp_path) -> None:
    """The training forward merges adapters layer by layer inside the scan (``LayerAdapters``);
    its loss and adapter gradients are those of the model merged up front (``lora.merged``),
    also under full remat, where the merge is recomputed in the backward pass."""
    from jaxrl.models.decoder import LayerAdapters
    from jaxrl.trainer.lora import merged

    _tiny_hf(tmp_path)
    model = load_decoder(tmp_path)
    graphdef, base = nnx.split(model)
    rng = np.random.default_rng(0)
    adapters = {}
    for w, _ in TARGETS.values():
        shape = getattr(model, w)[...].shape
        n_in = dict(TARGETS.values())[w]
        a_shape, b_shape = (*shape[: 1 + n_in], 4), (shape[0], 4, *shape[1 + n_in :])
        adapters[w] = {"a": jnp.asarray(rng.normal(0, 0.1, a_shape), jnp.float32),
                       "b": jnp.asarray(rng.normal(0, 0.1, b_shape), jnp.float32)}  # fmt: skip
    tokens = jnp.asarray(rng.integers(0, 97, (2, 12)))
    positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)

    def loss(adapters, per_layer: bool, remat: str) -> jax.Array:
        m = nnx.merge(graphdef, base if per_layer else merged(base, adapters, 2.0))
        m.remat = remat
        hidden, _ = m(tokens, positions, lora=LayerAdapters(adapters, 2.0) if per_layer else None)
        return jnp.mean(m.logits(hidden) ** 2)

    want, want_grads = jax.value_and_grad(loss)(adapters, False, "none")
    for remat in ("none", "full"):
        got, grads = jax.jit(jax.value_and_grad(loss), static_argnums=(1, 2))(adapters, True, remat)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for w in adapters:
            for ab in ("a", "b"):
                np.testing.assert_allclose(grads[w][ab], want_grads[w][ab], rtol=1e-4, atol=1e-6)
