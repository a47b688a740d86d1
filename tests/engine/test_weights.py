"""Weight updates: in-process from a differently sharded trainer state, from a HF directory,
the policy version counter, and which version requests in flight finish on."""

from __future__ import annotations

import json
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request, TokenDelta
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.models.hf_io import copy_model_dir, load_decoder

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def _req(max_tokens: int = 12, seed: int = 0, prompt: list[int] = PROMPT) -> Request:
    return Request(prompt, SamplingParams(max_tokens=max_tokens, seed=seed))


@pytest.fixture(scope="module")
def engine(model_dir, make_config) -> Engine:
    return Engine.from_pretrained(model_dir, make_config())


def _wait_for_tokens(engine: Engine, before: int) -> None:
    deadline = time.monotonic() + 60
    while engine.stats.generated_tokens == before and time.monotonic() < deadline:
        time.sleep(0.002)


def test_update_from_trainer_state_on_another_mesh(
    model_dir, other_model_dir, make_config, score, kl
) -> None:
    """Trainer params sharded over 8 devices ("fsdp") -> engine tensor-parallel on 2 devices."""
    devices = jax.devices()
    assert len(devices) >= 8, "tests/conftest.py provides 8 CPU devices"
    trainer_mesh = Mesh(np.array(devices[:8]), ("fsdp",))

    def trainer_sharding(name: str, shape: tuple[int, ...]) -> NamedSharding:
        spec = [None] * len(shape)
        if shape[-1] % 8 == 0:
            spec[-1] = "fsdp"
        return NamedSharding(trainer_mesh, PartitionSpec(*spec))

    trainer = load_decoder(other_model_dir, sharding_fn=trainer_sharding)
    engine_mesh = Mesh(np.array(devices[:2]), ("tensor",))
    engine = Engine.from_pretrained(model_dir, make_config(), mesh=engine_mesh)

    before = engine.generate([_req()])[0]
    assert before.policy_version == 0
    assert kl(score(load_decoder(model_dir), PROMPT, before.token_ids, 1.0), before.logprobs) <= 1e-6

    expected = {
        jax.tree_util.keystr(p): x.sharding for p, x in jax.tree_util.tree_flatten_with_path(engine.params)[0]
    }
    assert engine.update_weights_from_state(nnx.state(trainer)) == 1 == engine.policy_version
    for x in jax.tree.leaves(nnx.state(trainer)):  # the trainer may donate its buffers next step
        x.delete()
    for p, x in jax.tree_util.tree_flatten_with_path(engine.params)[0]:
        assert x.sharding == expected[jax.tree_util.keystr(p)]
    assert any(
        len(x.sharding.device_set) == 2 and not x.sharding.is_fully_replicated
        for x in jax.tree.leaves(engine.params)
    )

    after = engine.generate([_req()])[0]
    assert after.policy_version == after.policy_version_final == 1
    assert kl(score(load_decoder(other_model_dir), PROMPT, after.token_ids, 1.0), after.logprobs) <= 1e-6
    assert after.token_ids != before.token_ids


def test_engine_serves_a_copy_of_the_model_it_is_given(model_dir, make_config, score, kl) -> None:
    trainer_model = load_decoder(model_dir)
    engine = Engine(trainer_model, make_config())
    for x in jax.tree.leaves(nnx.state(trainer_model)):  # e.g. donated by the trainer's next step
        x.delete()
    out = engine.generate([_req()])[0]
    assert kl(score(load_decoder(model_dir), PROMPT, out.token_ids, 1.0), out.logprobs) <= 1e-6


def test_place_state_reshards_casts_and_checks_names_and_shapes(model_dir) -> None:
    from jaxrl.engine.weights import param_sharding_fn, place_state, state_shardings

    engine_like = nnx.state(load_decoder(model_dir, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16))
    shardings = state_shardings(engine_like, param_sharding_fn(None))
    trainer_state = nnx.state(load_decoder(model_dir))  # float32
    placed = place_state(trainer_state, engine_like, shardings)
    for got, want in zip(jax.tree.leaves(placed), jax.tree.leaves(trainer_state)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(jnp.bfloat16)))
    bad = jax.tree.map(lambda x: x[..., :1], trainer_state)
    with pytest.raises(ValueError, match="has shape"):
        place_state(bad, engine_like, shardings)
    with pytest.raises(ValueError, match="missing"):
        place_state({"embed": trainer_state["embed"]}, engine_like, shardings)


def test_update_from_hf_directory_and_version_rules(engine, other_model_dir, tmp_path, score, kl) -> None:
    before = engine.generate([_req()])[0]
    assert engine.update_weights_from_path(other_model_dir) == 1
    # The cached prefix of the same prompt came from the old weights and must not be reused.
    after = engine.generate([_req()])[0]
    assert after.cached_prompt_tokens == 0 and after.policy_version == 1
    assert kl(score(load_decoder(other_model_dir), PROMPT, after.token_ids, 1.0), after.logprobs) <= 1e-6
    assert after.token_ids != before.token_ids

    with pytest.raises(ValueError, match="greater than 1"):
        engine.update_weights_from_path(other_model_dir, version=1)
    with pytest.raises(FileNotFoundError):
        engine.update_weights_from_path(tmp_path / "missing")
    changed = tmp_path / "changed"
    shutil.copytree(other_model_dir, changed)
    cfg = json.loads((changed / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (changed / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="different architecture"):
        engine.update_weights_from_path(changed)
    assert engine.policy_version == 1


def test_drain_finishes_requests_in_flight_on_the_old_weights(
    engine, model_dir, other_model_dir, score, kl
) -> None:
    """weight_update = "drain": requests in flight never see the new weights; later ones only do.

    Self-contained (pytest-xdist may run the module's other tests on the other worker, so the
    shared engine's version is whatever ran here before): the old weights go in first."""
    old = load_decoder(other_model_dir)
    new = load_decoder(model_dir)
    v_old = engine.update_weights_from_state(nnx.state(old))  # the engine is not started: swaps now
    v_new = v_old + 4
    engine.start()
    try:
        before = engine.stats.generated_tokens
        inflight_reqs = [_req(max_tokens=100, seed=s, prompt=[7, 7, s]) for s in range(3)]
        inflight = [engine.submit(r) for r in inflight_reqs]
        _wait_for_tokens(engine, before)
        assert engine.update_weights_from_state(nnx.state(new), version=v_new, wait=False) == v_new
        assert not all(f.done() for f in inflight), "test needs requests in flight at the update"
        later_reqs = [_req(max_tokens=10, seed=s, prompt=[8, 8, s]) for s in range(2)]
        later = [engine.submit(r) for r in later_reqs]
        for r, f in zip(inflight_reqs, inflight):
            out = f.result(120)
            assert (out.policy_version, out.policy_version_final) == (v_old, v_old)
            assert kl(score(old, r.prompt, out.token_ids, 1.0), out.logprobs) <= 1e-6
        for r, f in zip(later_reqs, later):
            out = f.result(120)
            assert (out.policy_version, out.policy_version_final) == (v_new, v_new)
            assert kl(score(new, r.prompt, out.token_ids, 1.0), out.logprobs) <= 1e-6
    finally:
        engine.stop()
    assert engine.policy_version == v_new


def test_immediate_update_switches_requests_in_flight(model_dir, other_model_dir, make_config) -> None:
    """An immediate update mid-completion: each token reports the version that sampled it (old
    ones first, then new), in the completion and in the tokens streamed as they are sampled."""
    engine = Engine.from_pretrained(model_dir, make_config(weight_update="immediate", decode_steps=1))
    streamed: list[TokenDelta] = []
    request = _req(max_tokens=120)
    request.on_tokens = streamed.append
    engine.start()
    try:
        before = engine.stats.generated_tokens
        future = engine.submit(request)
        _wait_for_tokens(engine, before)
        assert engine.update_weights_from_path(other_model_dir) == 1
        out = future.result(120)
        assert (out.policy_version, out.policy_version_final) == (0, 1)
        switch = out.token_versions.index(1)
        assert 0 < switch < len(out.token_ids) == len(out.token_versions)
        assert out.token_versions == [0] * switch + [1] * (len(out.token_ids) - switch)
        assert [t for d in streamed for t in d.token_ids] == out.token_ids
        assert [v for d in streamed for v in d.versions] == out.token_versions
        assert [x for d in streamed for x in d.logprobs] == out.logprobs
    finally:
        engine.stop()


def test_copy_model_dir_copies_a_loadable_model_and_refuses_a_non_model(model_dir, tmp_path) -> None:
    """The copy external rollout backends use for shared storage (here local -> local, the same
    ``etils.epath`` calls a gs:// URL goes through)."""
    copy_model_dir(model_dir, tmp_path / "a" / "b")
    want, got = nnx.state(load_decoder(model_dir)), nnx.state(load_decoder(tmp_path / "a" / "b"))
    for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        copy_model_dir(tmp_path / "a", tmp_path / "c")
