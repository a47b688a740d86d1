"""``python -m jaxrl.serve``: start on a free port, answer, stop on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest
from helpers import wait_for_serve_url


@pytest.mark.slow  # a `jaxrl.serve` process: the slow tier (test_server keeps a real HTTP server in the fast tier)
def test_serve_cli_serves_and_stops_on_sigterm(model_dir, tokenizer_dir) -> None:
    cmd = [
        sys.executable, "-m", "jaxrl.serve",
        "--model.name", str(model_dir),
        "--model.tokenizer", str(tokenizer_dir),
        "--inference.server.port", "0",
        "--inference.max_model_len", "64",
        "--inference.max_seqs", "2",
        "--inference.backend.prefill_len_buckets", "[32]",
        "--inference.backend.prefill_batch_buckets", "[1]",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )
    try:
        url = wait_for_serve_url(proc)
        assert url.startswith("http://127.0.0.1:")
        models = httpx.get(url + "/v1/models").json()["data"]
        assert models[0]["id"] == str(model_dir) and models[0]["max_model_len"] == 64
        body = {
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 4, "logprobs": 1, "ignore_eos": True},
        }
        out = httpx.post(url + "/inference/v1/generate", json=body, timeout=120).json()
        assert len(out["choices"][0]["logprobs"]["content"]) == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # a `jaxrl.serve` process per bad config: the slow tier
def test_serve_config_errors_exit_2_with_one_message_before_loading(model_dir, tmp_path) -> None:
    """Bad TOML names the file; a missing model dir and a port in use are found before the model
    loads; a bad field is named."""
    import socket

    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[inference\nport = 1")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, needle in (
            (["--config", str(bad_toml)], f"--config {bad_toml}: invalid TOML"),
            (["--model.name", str(tmp_path / "nope")], "model.name"),
            (
                ["--model.name", str(model_dir), "--inference.server.port", str(port)],
                f"inference.server.port = {port}",
            ),
            (["--model.name", str(model_dir), "--inference.max_seqs", "0"], "inference.max_seqs"),
        ):
            r = subprocess.run(
                [sys.executable, "-m", "jaxrl.serve", *args], capture_output=True, text=True, timeout=120
            )
            assert r.returncode == 2, r.stderr[-2000:]
            assert r.stderr.startswith("error: ") and needle in r.stderr, r.stderr[-2000:]
            assert "Traceback" not in r.stderr


def test_a_port_taken_after_start_up_checks_is_named() -> None:
    """A port free at the start-up check but taken before the server binds (e.g. during a warm
    start) is reported as PortInUse naming the field, which the entry points turn into exit 2."""
    import socket

    from fastapi import FastAPI

    from jaxrl.serving.http_thread import BackgroundServer, PortInUse

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortInUse, match=rf"127.0.0.1:{port} .*inference.server.port"):
            BackgroundServer(FastAPI(), "127.0.0.1", port, name="jaxrl-engine-http", keep_alive_s=5).start()


def _dry_run(argv: list[str], capsys) -> tuple[int, dict, str]:
    """``jaxrl.serve``'s resolved config for ``argv`` (``--dry-run``: no model loads)."""
    import tomllib

    from jaxrl.serve import main

    code = main([*argv, "--dry-run"])
    out, err = capsys.readouterr()
    return code, (tomllib.loads(out) if code == 0 else {}), err.strip()


@pytest.fixture
def model_dir_stub(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"max_position_embeddings": 4096}')
    return d


@pytest.mark.parametrize(
    ("flags", "path", "value"),
    [
        (["--port", "8123"], ("inference", "server", "port"), 8123),
        (["--port=8124"], ("inference", "server", "port"), 8124),
        (["--host", "0.0.0.0"], ("inference", "server", "host"), "0.0.0.0"),
        (["--max-model-len", "2048"], ("inference", "max_model_len"), 2048),
        (["--max_model_len", "1024"], ("inference", "max_model_len"), 1024),
        (["--tensor-parallel-size", "4"], ("inference", "backend", "tensor_parallel"), 4),
        (["--served-model-name", "my-model"], ("inference", "server", "served_model_name"), "my-model"),
        (["--max-num-seqs", "7"], ("inference", "max_seqs"), 7),
        (["--tokenizer", "/tok"], ("model", "tokenizer"), "/tok"),
    ],
)
def test_vllm_flag_spellings_set_the_jaxrl_field(flags, path, value, model_dir_stub, capsys) -> None:
    """A ``vllm serve`` command line starts jaxrl.serve: each of vLLM's flags that means exactly
    a jaxrl field sets that field (never accepted and ignored)."""
    code, cfg, err = _dry_run(["--model.name", str(model_dir_stub), *flags], capsys)
    assert code == 0, err
    node = cfg
    for key in path:
        node = node[key]
    assert node == value


def test_vllm_model_flag_is_the_model_name_and_the_section_form_still_works(model_dir_stub, capsys) -> None:
    code, cfg, err = _dry_run(["--model", str(model_dir_stub), "--port", "9000"], capsys)
    assert code == 0, err
    assert cfg["model"]["name"] == str(model_dir_stub) and cfg["inference"]["server"]["port"] == 9000
    code, cfg, err = _dry_run(["--model", f'{{"name": "{model_dir_stub}"}}'], capsys)
    assert code == 0, err
    assert cfg["model"]["name"] == str(model_dir_stub)


@pytest.mark.parametrize(
    ("flag", "hint"),
    [
        ("--gpu-memory-utilization", "--inference.max_seqs"),
        ("--pipeline-parallel-size", "--inference.backend.tensor_parallel"),
        ("--dtype", "--model.dtype"),
    ],
)
def test_vllm_flags_without_an_equivalent_fail_in_one_line_naming_the_jaxrl_setting(
    flag, hint, model_dir_stub, capsys
) -> None:
    code, _, err = _dry_run(["--model", str(model_dir_stub), flag, "0.9"], capsys)
    assert code == 2
    assert err.startswith(f"error: {flag} (vLLM's flag) has no jaxrl.serve equivalent") and hint in err
    assert len(err.splitlines()) == 1


def test_colocated_engine_settings_are_refused_by_the_one_process_server(model_dir_stub, capsys) -> None:
    """``colocated_*`` configure an engine spread over a multi-process trainer: jaxrl.serve would
    accept and never read them, so it refuses them naming the field (the defaults pass)."""
    base = ["--model.name", str(model_dir_stub), "--inference.backend.type", "embedded"]
    code, _, err = _dry_run([*base, "--inference.backend.colocated_port", "8478"], capsys)
    assert code == 2 and err.count("\n") == 0 and "inference.backend.colocated_port" in err and "delete it" in err
    code, cfg, err = _dry_run(base, capsys)
    assert code == 0, err
    assert cfg["inference"]["backend"]["colocated_host"] == "127.0.0.1"
