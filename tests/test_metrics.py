"""Run output: metrics / rollouts logs."""

from __future__ import annotations

import json

from jaxrl.metrics import truncate_jsonl


def test_truncate_jsonl_keeps_records_up_to_the_checkpoint(tmp_path) -> None:
    log = tmp_path / "rollouts.jsonl"
    rows = [{"step": s, "fate": "trained"} for s in (0, 1, 2, 3, 3)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "fa')
    assert truncate_jsonl(log, 2) == 3
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]
    assert truncate_jsonl(tmp_path / "missing.jsonl", 2) == 0
