"""Models by hub id: a local HF cache (``models--org--name/{blobs,snapshots,refs}``, the layout
huggingface_hub writes) built from a tiny model, loaded by id with ``HF_HUB_OFFLINE=1`` through
the real entry point (no network, no mock of huggingface_hub)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import wait_for_serve_url

REPO = "jaxrl-test/tiny-qwen3"


def write_hub_cache(hub_cache: Path, repo_id: str, files_from: list[Path], revision: str, refs: tuple[str, ...]) -> Path:
    """A snapshot of ``files_from``'s files in huggingface_hub's cache layout; returns its dir."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for src_dir in files_from:
        for f in sorted(src_dir.iterdir()):
            data = f.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.write_bytes(data)
            (snap / f.name).unlink(missing_ok=True)  # a later source overrides an earlier one
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(revision)
    return snap


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return env | {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow  # a `jaxrl.serve` process: the slow tier
def test_serve_loads_a_hub_id_from_the_offline_cache(model_dir, tokenizer_dir, tmp_path) -> None:
    hf_home = tmp_path / "hf"
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"eos_token_id": [5]}))
    snap = write_hub_cache(hf_home / "hub", REPO, [model_dir, tokenizer_dir, gen], "a" * 40, ("main",))
    cmd = [
        sys.executable, "-m", "jaxrl.serve",
        "--model.name", REPO,
        "--inference.server.port", "0",
        "--inference.max_model_len", "64",
        "--inference.max_seqs", "2",
        "--inference.backend.prefill_len_buckets", "[32]",
        "--inference.backend.prefill_batch_buckets", "[1]",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=offline_env(hf_home))
    try:
        url = wait_for_serve_url(proc)
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == REPO
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3, "logprobs": 1, "ignore_eos": True}}
        out = httpx.post(url + "/inference/v1/generate", json=body, timeout=120).json()
        assert len(out["choices"][0]["token_ids"]) == 3
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert snap.is_dir()


RESOLVE = """
import json, sys
from jaxrl.models.hub import resolve_model_dir
for name, revision in json.loads(sys.argv[1]):
    try:
        print("OK", resolve_model_dir(name, revision or None))
    except FileNotFoundError as e:
        print("ERR", str(e).replace(chr(10), " "))
"""


def resolve_all(hf_home: Path, queries: list[tuple[str, str]]) -> list[str]:
    """Each (name, revision) resolved in one fresh process: huggingface_hub reads HF_HOME and
    HF_HUB_OFFLINE when it is imported (one process for all, not one each: ~7 s of imports apiece)."""
    out = subprocess.run(
        [sys.executable, "-c", RESOLVE, json.dumps(queries)], env=offline_env(hf_home), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    answers = [line for line in out.stdout.splitlines() if line.startswith(("OK ", "ERR "))]
    assert len(answers) == len(queries), out.stdout
    return answers


def test_revisions_and_the_offline_miss_error(model_dir, tmp_path) -> None:
    hf_home = tmp_path / "hf"
    old = write_hub_cache(hf_home / "hub", REPO, [model_dir], "1" * 40, ("v1",))
    new = write_hub_cache(hf_home / "hub", REPO, [model_dir], "2" * 40, ("main",))
    bad_dir = str(tmp_path / "no" / "such" / "dir")
    head, by_tag, by_hash, miss, local, bad = resolve_all(
        hf_home, [(REPO, ""), (REPO, "v1"), (REPO, "1" * 40), ("jaxrl-test/not-cached", ""), (str(model_dir), ""), (bad_dir, "")]
    )
    assert head == f"OK {new}"
    assert by_tag == f"OK {old}"
    assert by_hash == f"OK {old}"
    assert miss.startswith("ERR") and "'jaxrl-test/not-cached'" in miss and "HF_HUB_OFFLINE" in miss
    assert str(hf_home / "hub") in miss
    # A local directory is used as given; a path that is neither a directory nor a hub id is named.
    assert local == f"OK {model_dir}"
    assert bad.startswith("ERR") and "no such directory" in bad
    shutil.rmtree(hf_home)
