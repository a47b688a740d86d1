"""The command line of every entry point: argv -> overrides -> ``RunConfig`` (DESIGN contract 7).

``load_config(argv)`` reads ``--config FILE`` (optional: every field has a default; ``@ FILE`` is
prime-rl's form), applies ``--section.field value`` overrides (parsed by pydantic-settings' CLI
source, so types and unknown names are checked by the same models) and validates the result as
one ``RunConfig`` (``jaxrl.config``): every check the config allows runs here, before any work,
and a bad field fails with one line naming it. Spellings other tools or older configs use are
translated on the way in: prime-rl's flag habits (``prime_rl_flags``), the backend as a string
(``--inference.backend vllm``), the older ``[inference.vllm]`` / ``[inference.external]`` sections,
and the embedded engine's settings written in ``[inference]`` itself (moved under
``[inference.backend]`` with a one-line rename hint on stderr).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict, SettingsError

from jaxrl import renamed
from jaxrl.config import RunConfig, read_toml
from jaxrl.rollout.config import BACKEND_SECTIONS, ENGINE_KEYS, engine_settings_moved, rename_hint


class _Cli(BaseSettings):
    """Carrier for pydantic-settings' CLI parser (dotted overrides of RunConfig fields)."""

    model_config = SettingsConfigDict(extra="forbid", cli_prog_name="jaxrl")


def _cli_model(fields: Sequence[str] | None = None, hidden: Mapping[str, str] | None = None) -> type[BaseSettings]:
    """The CLI's model: RunConfig's fields, or only the ``fields`` sections an entry point reads,
    without the ``hidden`` ``section.field`` paths it refuses (so ``--help`` does not offer them)."""
    from pydantic import Field as _Field
    from pydantic import create_model

    chosen = {n: (f.annotation, f) for n, f in RunConfig.model_fields.items() if fields is None or n in fields}
    for path in hidden or {}:
        section, name = path.split(".", 1)
        info = RunConfig.model_fields[section]
        model: Any = info.annotation
        kept = {n: (f.annotation, f) for n, f in model.model_fields.items() if n != name}
        reduced = create_model(model.__name__, __config__=model.model_config, **kept)
        chosen[section] = (reduced, _Field(default_factory=reduced, description=info.description))
    return create_model("RunCli", __base__=_Cli, **chosen)  # type: ignore[call-overload]


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_args(
    argv: list[str] | None,
    prog: str = "python -m jaxrl.train",
    fields: Sequence[str] | None = None,
    hidden: Mapping[str, str] | None = None,
    refused_flags: Mapping[str, str] | None = None,
) -> tuple[argparse.Namespace, list[str]]:
    """The entry points' own flags; everything else is a dotted override. ``--help`` lists both
    (every field of ``fields`` sections, default all, with its type, default and docstring) and
    exits 0. ``@ FILE`` (prime-rl's form) is ``--config FILE``. ``refused_flags``: own flags
    (``"resume"``) this entry point has no use for, each with the reason: not offered, and
    refused with the reason when given (never accepted and ignored)."""
    refused = dict(refused_flags or {})
    parser = argparse.ArgumentParser(
        prog=prog,
        add_help=False,
        allow_abbrev=False,  # "--conf" must not swallow anything: unknown flags are overrides
        description="Run with a TOML config (every field has a default) and dotted overrides of its fields.",
        epilog="overrides: --section.field VALUE, every field listed below",
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help (and every field) and exit")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="TOML file (or `@ FILE`); repeat to merge several, later files winning field by field",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config as TOML, exit")
    parser.set_defaults(resume=False, overwrite=False)
    if fields is None or "output_dir" in fields:  # flags of an entry point that writes a run
        if "resume" not in refused:
            parser.add_argument(
                "--resume", action="store_true", help="continue from the latest checkpoint in output_dir"
            )
        parser.add_argument(
            "--overwrite", action="store_true", help="delete what output_dir holds (an earlier run) and start over"
        )
    args = prime_rl_flags(_at_files(list(sys.argv[1:] if argv is None else argv)))
    flags, rest = parser.parse_known_args(args)
    if flags.help:
        print(parser.format_help())
        CliSettingsSource(_cli_model(fields, hidden), cli_prog_name=prog, cli_parse_args=["--help"])()  # exits 0
    for arg in rest:
        name = arg.removeprefix("--").split("=", 1)[0]
        if arg.startswith("--") and name in refused:
            raise ValueError(f"--{name}: {refused[name]}")
    return flags, rest


def _at_files(argv: list[str]) -> list[str]:
    """prime-rl's ``@ cfg.toml`` / ``@cfg.toml`` as ``--config cfg.toml``."""
    out: list[str] = []
    args = iter(argv)
    for a in args:
        if a == "@":
            out += ["--config", next(args, "")]
        elif a.startswith("@") and len(a) > 1:
            out += ["--config", a[1:]]
        else:
            out.append(a)
    return out


_OWN_FLAGS = {"dry_run": "dry-run"}  # the entry points' own flags keep their argparse spelling
_ALIASES = {"ckpt.resume": "resume"}  # prime-rl's spelling of an entry-point flag


def prime_rl_flags(argv: list[str]) -> list[str]:
    """prime-rl's flag habits in jaxrl's spelling: kebab-case keys (``--inference.max-model-len``
    is ``--inference.max_model_len``), a bare boolean field (``--log.tensorboard`` alone means
    true, as pydantic-settings' implicit flags do in prime-rl) and ``--ckpt.resume`` (``--resume``).
    Only flag names are rewritten, never values."""
    bools = bool_paths()
    out: list[str] = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        key = _ALIASES.get(key, _OWN_FLAGS.get(key, key))
        out.append(f"--{key}{eq}{value}")
        bare = not eq and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
        if bare and key in bools:
            out.append("true")
    return out


def bool_paths(model: type[BaseModel] | None = None, prefix: str = "") -> set[str]:
    """Dotted paths of every boolean field (the flags that may stand alone)."""
    out: set[str] = set()
    for name, info in (model or RunConfig).model_fields.items():
        if info.annotation is bool or (get_origin(info.annotation) is not None and set(get_args(info.annotation)) == {bool, type(None)}):
            out.add(prefix + name)
        for sub in _submodels(info.annotation):
            out |= bool_paths(sub, f"{prefix}{name}.")
    return out


def field_paths(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted path an override can name: sections and their fields (not into lists)."""
    out: list[str] = []
    for name, info in (model or RunConfig).model_fields.items():
        out.append(prefix + name)
        for sub in _submodels(info.annotation):
            out += field_paths(sub, f"{prefix}{name}.")
    return out


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (list, dict, tuple):
        return []
    return [m for a in get_args(annotation) for m in _submodels(a)]


def _unknown_flag(flag: str) -> str:
    """What an override the config does not have should be: its prime-rl rename, or the nearest field."""
    key = flag.lstrip("-").split("=", 1)[0]
    nested: dict[str, Any] = {}
    node = nested
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = 1
    if found := renamed.find_renamed(nested):
        return f"--{key}: prime-rl key: " + "; ".join(found)
    close = difflib.get_close_matches(key, field_paths(), n=1, cutoff=0.75)
    hint = f"did you mean --{close[0]}?" if close else "--help lists every field"
    return f"unknown flag --{key}: {hint}"


_NO_INPUT = ("value_error", "assertion_error", "missing")  # their message says it all (or there is no input)


def one_line(e: ValidationError) -> str:
    """A pydantic error as one line per problem, each naming its field, joined by '; '."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ").replace("\n", " ")
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, field_paths(), n=1, cutoff=0.75)
            msg = "unknown field" + (f"; did you mean {close[0]}?" if close else "")
        elif err["type"] not in _NO_INPUT and not isinstance(err.get("input"), (dict, list)):
            msg += f" (got {err.get('input')!r})"
        parts.append(f"{loc}: {msg}" if loc and not msg.startswith(loc.rsplit(".", 1)[-1]) else msg)
    return "; ".join(parts)


def _backend_as_table(config: dict[str, Any]) -> dict[str, Any]:
    """``[inference]`` with ``backend = "<type>"`` written as the table ``{type = "<type>"}``, and
    the embedded engine's settings moved from ``[inference]`` under it, so that a TOML file and
    command-line overrides of the backend merge field by field."""
    inference = config.get("inference")
    if not isinstance(inference, dict):
        return config
    if isinstance(inference.get("backend"), str):
        inference = inference | {"backend": {"type": inference["backend"]}}
    return config | {"inference": engine_settings_moved(inference)}


def backend_flags(args: list[str]) -> list[str]:
    """Command-line overrides with the backend's written as fields of ``inference.backend``:
    ``--inference.backend vllm`` as ``--inference.backend.type vllm`` (so that it merges with
    ``--inference.backend.python ...`` instead of replacing it), the older shape's
    ``--inference.vllm.X`` / ``--inference.external.X`` as ``--inference.backend.X``, and the
    embedded engine's settings (``--inference.decode_steps``) as ``--inference.backend.X``, with a
    rename hint."""
    out = []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        given = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if flag == "--inference.backend" and not given.lstrip().startswith("{"):
            arg = "--inference.backend.type" + eq + value
        for name in BACKEND_SECTIONS:
            if arg.startswith(f"--inference.{name}."):
                arg = "--inference.backend." + arg.removeprefix(f"--inference.{name}.")
        if flag.removeprefix("--inference.") in ENGINE_KEYS:
            rename_hint(flag, f"--inference.backend.{flag.removeprefix('--inference.')}")
            arg = "--inference.backend." + arg.removeprefix("--inference.")
        out.append(arg)
    return out


def _cli_backend_wins(toml: dict[str, Any], cli: dict[str, Any]) -> dict[str, Any]:
    """A backend chosen on the command line replaces the file's: the file's settings for another
    backend are dropped, not refused. A recipe names how its trainer reaches rollout servers;
    ``jaxrl.serve --config rl.toml --inference.backend embedded`` (GKE's rendered rollout pods)
    serves that recipe's model as one of those servers. A file's backend table that names no type
    and holds only the embedded engine's settings (the older ``[inference] decode_steps = 8``,
    moved) is the default backend's: kept for the embedded backend (the rollout servers read it),
    dropped with any other."""
    chosen = ((cli.get("inference") or {}).get("backend") or {}).get("type")
    inference = toml.get("inference")
    if chosen is None or not isinstance(inference, dict):
        return toml
    backend = inference.get("backend") or {}
    named = backend.get("type") if isinstance(backend, dict) else None
    if named == chosen:
        return toml
    engine_only = named is None and isinstance(backend, dict) and bool(backend) and backend.keys() <= ENGINE_KEYS
    keep_backend = engine_only and chosen == "embedded"
    kept = {
        k: v for k, v in inference.items()
        if (k != "backend" or keep_backend) and (k not in BACKEND_SECTIONS or k == chosen)
    }  # fmt: skip
    return toml | {"inference": kept}


def build_config(
    toml: dict[str, Any],
    overrides: list[str],
    fields: Sequence[str] | None = None,
    hidden: Mapping[str, str] | None = None,
) -> RunConfig:
    """TOML dict + CLI override strings -> validated RunConfig (raises ValueError with the field).
    ``hidden``: ``section.field`` paths the entry point refuses, each with the reason."""
    overrides = backend_flags(overrides)
    for arg in overrides:
        key = arg.lstrip("-").split("=", 1)[0]
        for path, reason in (hidden or {}).items():
            if arg.startswith("--") and (key == path or key.startswith(path + ".")):
                raise ValueError(f"--{key}: {reason}")
    try:
        cli = CliSettingsSource(_cli_model(fields, hidden), cli_parse_args=overrides, cli_exit_on_error=False)()
    except SettingsError as e:
        unknown = re.search(r"unrecognized arguments: (.*)", str(e))
        flags = [t for t in unknown.group(1).split() if t.startswith("--")] if unknown else []
        if not flags:
            raise ValueError(str(e).replace("\n", " ")) from None
        raise ValueError("; ".join(_unknown_flag(f) for f in flags)) from None
    toml, cli = _backend_as_table(toml), _backend_as_table(cli)
    toml = _cli_backend_wins(toml, cli)
    try:
        return RunConfig.model_validate(deep_merge(toml, cli))
    except ValidationError as e:
        raise ValueError(f"invalid config: {one_line(e)}") from None


def load_config(
    argv: list[str] | None = None,
    prog: str = "python -m jaxrl.train",
    fields: Sequence[str] | None = None,
    defaults: dict[str, Any] | None = None,
    hidden: Mapping[str, str] | None = None,
    refused_flags: Mapping[str, str] | None = None,
) -> tuple[RunConfig, argparse.Namespace]:
    """Parse an entry point's argv: (validated config, flags --config/--dry-run/--resume/--overwrite).
    Several ``--config`` files merge left to right over the entry point's own ``defaults``;
    overrides apply last. ``fields``: the top-level sections the entry point reads (``--help`` and
    overrides are limited to them); ``hidden``: ``section.field`` paths of them it refuses, with
    the reason (left out of ``--help``; an override of one fails with the reason); ``refused_flags``:
    its own flags likewise (``{"resume": reason}``)."""
    flags, rest = parse_args(argv, prog, fields, hidden, refused_flags)
    toml: dict[str, Any] = dict(defaults or {})
    for path in flags.config:
        toml = deep_merge(toml, resolve_recipe_paths(read_toml(path), Path(path).parent))
    return build_config(toml, rest, fields, hidden), flags


def resolve_recipe_paths(data: dict[str, Any], recipe_dir: Path) -> dict[str, Any]:
    """A recipe's relative ``[warmstart] config`` names a file beside the recipe, so a recipe
    runs from any working directory (outputs, like ``output_dir``, stay relative to it)."""
    warm = data.get("warmstart")
    if isinstance(warm, dict) and isinstance(warm.get("config"), str) and not Path(warm["config"]).is_absolute():
        data = {**data, "warmstart": {**warm, "config": str((recipe_dir / warm["config"]).resolve())}}
    return data


def to_toml(cfg: BaseModel, include: set[str] | None = None) -> str:
    """The resolved config as TOML that ``--config`` reads back to the same config (unset
    optional values, None, are left out: their default is None)."""
    import tomli_w

    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True, include=include))
