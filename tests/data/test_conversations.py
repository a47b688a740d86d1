"""SFT on the user's conversations: JSONL / directories / hub dataset ids, bad rows with their
file and line, skipped and counted on request, and a real SFT run on a tool conversation file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from families import build_family_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from test_hub import write_hub_cache

from jaxrl.cli import build_config
from jaxrl.data.conversations import load_conversations

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Code of a word",
          "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}]  # fmt: skip


def tool_row(key: str, code: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"key": key})}}
    return {
        "messages": [
            {"role": "system", "content": "Answer with codes."},
            {"role": "user", "content": f"What is the code of '{key}'?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": code},
            {"role": "assistant", "content": code},
        ],
        "tools": TOOLS,
    }


def plain_row(q: str, a: str) -> dict:
    return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


BAD = [
    ("{not json", "not JSON"),
    (json.dumps({"messages": []}), "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant message"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}), "role"),
    (json.dumps({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}), "name"),
]


@pytest.mark.parametrize(("line", "why"), BAD)
def test_a_bad_row_names_its_file_and_line(tmp_path, line, why) -> None:
    f = write_jsonl(tmp_path / "data.jsonl", [plain_row("a", "b"), "", line, plain_row("c", "d")])
    with pytest.raises(ValueError, match=rf"(?s)bad row at {f}:3: .*{why}.*skip_bad_rows"):
        load_conversations(str(f))


def test_bad_rows_skipped_and_counted_and_directories(tmp_path) -> None:
    d = tmp_path / "set"
    d.mkdir()
    write_jsonl(d / "b.jsonl", [plain_row("c", "d"), *(line for line, _ in BAD)])
    write_jsonl(d / "a.jsonl", [tool_row("abc", "bcd")])
    loaded = load_conversations(str(d), skip_bad_rows=True)
    assert loaded.skipped == len(BAD) and len(loaded.reasons) == len(BAD)
    assert loaded.sources == [f"{d / 'a.jsonl'}:1", f"{d / 'b.jsonl'}:1"]  # files in name order
    (messages, tools), _ = loaded.examples
    assert tools == TOOLS and messages[2]["tool_calls"][0]["function"]["name"] == "lookup"
    # a check (the run renders every row) makes a row bad too
    with pytest.raises(ValueError, match=r"a\.jsonl:1: too long"):
        load_conversations(str(d), skip_bad_rows=False, check=lambda ex: (_ for _ in ()).throw(ValueError("too long")))


def test_a_hub_dataset_id_from_the_offline_cache(tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "train.jsonl", [plain_row("q", "a"), tool_row("abc", "bcd")])
    hub = tmp_path / "hub"
    repo = write_hub_cache(hub, "jaxrl-test/convs", [src], "3" * 40, ("main",))
    (hub / "datasets--jaxrl-test--convs").parent.mkdir(exist_ok=True)
    (hub / "models--jaxrl-test--convs").rename(hub / "datasets--jaxrl-test--convs")  # a dataset repo's cache name
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = load_conversations("jaxrl-test/convs")
    assert len(loaded.examples) == 2 and loaded.sources[0].endswith("train.jsonl:1") and repo.name == "3" * 40
    with pytest.raises(FileNotFoundError, match=rf"data.path = 'jaxrl-test/other': HF_HUB_OFFLINE is set .*{hub}"):
        load_conversations("jaxrl-test/other")


def test_config_rejects_mixed_sources() -> None:
    with pytest.raises(ValueError, match="either `path`"):
        build_config({"model": {"name": "org/m"}, "data": {"path": "x.jsonl", "taskset": "lookup"}}, [])
    with pytest.raises(ValueError, match="set data.path"):
        build_config({"model": {"name": "org/m"}, "data": {"skip_bad_rows": True}}, [])


@pytest.mark.slow
def test_sft_on_a_llama3_tool_conversation_file(tmp_path) -> None:
    """Two SFT steps on a JSONL of Llama 3 tool conversations (a bad row skipped and counted): the
    trainer's CE tokens are exactly the assistant's sampled tokens plus the tool outputs' content."""
    from transformers import AutoTokenizer

    from jaxrl.data.sft import render_for_sft
    from jaxrl.metrics import read_metrics
    from jaxrl.models.renderer import create_renderer
    from jaxrl.sft import run_sft

    model = build_family_model(tmp_path / "llama3", "llama3")
    rows = [tool_row("abc", "bcd"), tool_row("xyz", "yza"), "[1, 2]"]
    f = write_jsonl(tmp_path / "convs.jsonl", rows)
    out = tmp_path / "run"
    result = run_sft(build_config({
        "output_dir": str(out), "model": {"name": str(model)},
        "data": {"path": str(f), "skip_bad_rows": True, "content_roles": ["tool"], "batch_size": 2},
        "trainer": {"steps": 2, "seq_len": 1024, "seq_len_buckets": [1024], "micro_batch_rows": 2, "mesh": {"num_devices": 1}},
        "log": {"progress": False, "plot": False},
    }, []))  # fmt: skip
    assert (result["examples"], result["skipped_rows"]) == (2, 1)
    tok = AutoTokenizer.from_pretrained(model)
    renderer = create_renderer(tok, {"name": "llama-3"})
    expected = 0
    for row in rows[:2]:
        ids, mask = render_for_sft(renderer, row["messages"], row["tools"], frozenset({"tool"}))
        text = tok.decode(np.asarray(ids)[np.asarray(mask)])
        code = row["messages"][-1]["content"]
        assert text.endswith(f'"{code}"{code}<|eot_id|>')  # the tool body (JSON-quoted), then the answer
        expected += int(np.sum(mask))
    steps = read_metrics(out / "metrics.jsonl")
    assert [m["train/ce_tokens"] for m in steps] == [expected, expected]


@pytest.mark.slow
def test_sft_on_your_own_data_holds_out_an_eval_split(tmp_path) -> None:
    """`data.eval_fraction` holds out a seeded subset of `path` (never trained on) and
    `data.eval_path` names a held-out file: either is scored as `eval/ce_loss`."""
    from jaxrl.metrics import read_metrics
    from jaxrl.sft import hold_out, run_sft

    train, held = hold_out(list(range(20)), 0.25, seed=0)
    assert len(held) == 5 and sorted(train + held) == list(range(20)) and hold_out(list(range(20)), 0.25, 0)[1] == held
    rows = write_jsonl(tmp_path / "mine.jsonl", [plain_row(f"say {w}", w) for w in ("ab", "cd", "ef", "gh") * 5])
    other = write_jsonl(tmp_path / "held.jsonl", [plain_row("say zz", "zz")])
    scratch = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1,
               "head_dim": 32, "max_position_embeddings": 128}  # fmt: skip
    for i, held_cfg in enumerate(({"eval_fraction": 0.25}, {"eval_path": str(other)})):
        out = tmp_path / f"run{i}"
        result = run_sft(build_config({
            "output_dir": str(out), "model": {"scratch": scratch},
            "data": {"path": str(rows), "batch_size": 4, "eval_interval": 1, **held_cfg},
            "trainer": {"steps": 2, "seq_len": 128, "micro_batch_rows": 4, "mesh": {"num_devices": 1}},
            "log": {"progress": False, "plot": False},
        }, []))  # fmt: skip
        assert result["examples"] == (15 if i == 0 else 20)
        evals = [r for r in read_metrics(out / "metrics.jsonl") if "eval/ce_loss" in r]
        assert [r["step"] for r in evals] == [1, 2] and evals[0]["eval/ce_tokens"] > 0
    with pytest.raises(ValueError, match="eval_fraction"):
        build_config({"data": {"taskset": "lookup", "eval_fraction": 0.1}}, [])


def test_trl_prompt_completion_rows_train_as_messages(tmp_path) -> None:
    """TRL's SFTTrainer shapes (conversational and plain text) load as user/assistant turns."""
    f = tmp_path / "trl.jsonl"
    rows = [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
         "completion": [{"role": "assistant", "content": "4"}]},
        {"prompt": "Capital of France?", "completion": "Paris"},
    ]  # fmt: skip
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = load_conversations(str(f))
    assert [m["role"] for m in loaded.examples[0][0]] == ["system", "user", "assistant"]
    assert loaded.examples[1][0] == [{"role": "user", "content": "Capital of France?"},
                                     {"role": "assistant", "content": "Paris"}]  # fmt: skip
    f.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=rf"bad row at {f}:1: .*`prompt` and `completion`.*\['answer', 'question'\]"):
        load_conversations(str(f))
