"""What an `[[orchestrator.*.env]]` entry means to verifiers: the validated verifiers env config
(taskset id, args, each agent seat's runtime and harness), with the entry's errors in one line.

Loading the user's module happens here, so its own import errors surface as themselves
(`ModuleNotFoundError: No module named ...`), not as verifiers' "taskset not found".
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from jaxrl.envs import LOCAL_HARNESS, plugin_id, register_plugin
from jaxrl.orchestrator.config import EnvConfig

if TYPE_CHECKING:
    import verifiers.v1 as vf


def verifiers_env_config(config: EnvConfig) -> vf.EnvConfig:
    """The verifiers env config an entry describes, validated (clear errors before any spawn)."""
    from pydantic import ValidationError
    from verifiers.v1 import AgentConfig
    from verifiers.v1.utils.loaders import default_harness_id, env_config_type, resolve_env_config

    taskset_id, module = plugin_id(config.id)
    try:
        if module is None and importlib.util.find_spec(taskset_id.replace("-", "_")) is not None:
            importlib.import_module(taskset_id.replace("-", "_"))  # its own import errors, not "taskset not found"
        if module is not None:
            register_plugin(taskset_id, module)
        register_plugin(*LOCAL_HARNESS)
        own_harness = default_harness_id(taskset_id) == taskset_id  # the taskset module exports one
        data: dict[str, Any] = {**config.env_args, "taskset": {**config.args, "id": taskset_id}}
        for name, info in env_config_type(taskset_id, data.get("id", "")).model_fields.items():
            if isinstance(info.default, AgentConfig):
                seat = dict(data.get(name) or {})
                seat.setdefault("runtime", {"type": "subprocess"})
                if not own_harness and seat.get("harness") is None and info.default.harness is None:
                    seat["harness"] = {"id": LOCAL_HARNESS[0]}  # offline, not verifiers' networked `bash`
                data[name] = seat
        return resolve_env_config(data)
    except (ValidationError, ImportError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"env {config.name!r} (id {config.id!r}): {_env_error(e)}") from e


def _env_error(e: Exception) -> str:
    """An env's config or import error in one line: each field of the env's own config with its
    problem (no hints from the run config: the fields are the taskset's), or the exception's type
    and message (`ModuleNotFoundError: No module named 'x'` inside the user's module)."""
    from pydantic import ValidationError

    if isinstance(e, ValidationError):
        parts = []
        for err in e.errors():
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] not in ("value_error", "assertion_error", "missing") and not isinstance(err.get("input"), (dict, list)):
                msg += f" (got {err.get('input')!r})"
            parts.append(f"{'.'.join(map(str, err['loc'])) or 'config'}: {msg}")
        return "; ".join(parts)
    return f"{type(e).__name__}: {e}" if isinstance(e, ImportError) else str(e)
