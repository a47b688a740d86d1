"""``python -m jaxrl.serve``: start on a free port, answer, stop on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx


def test_serve_cli_serves_and_stops_on_sigterm(model_dir, tokenizer_dir) -> None:
    cmd = [
        sys.executable, "-m", "jaxrl.serve",
        "--model.name", str(model_dir),
        "--model.tokenizer", str(tokenizer_dir),
        "--inference.server.port", "0",
        "--inference.max_model_len", "64",
        "--inference.max_seqs", "2",
        "--inference.prefill_len_buckets", "[32]",
        "--inference.prefill_batch_buckets", "[1]",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )
    try:
        line = ""
        while "serving" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "jaxrl.serve exited before serving"
        url = line.rsplit(" at ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
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
