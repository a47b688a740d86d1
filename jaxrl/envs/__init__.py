"""Built-in environments (verifiers v1 tasksets) that run with no network.

- `reverse_text`: single turn, reverse a short text.
- `alphabet_sort`: multi-turn with a scripted user, keep a growing list of names sorted.
- `lookup`: multi-turn with a local tool whose output is a learnable function of its input
  (`shifts > 1`: a hidden per-task shift, so the answer needs what the tool returned).
- `reverse_duel`: two seats of one policy play reverse_text zero-sum (multi-agent credit).
- `needle`: long context, find one fact buried in a document of `context_words` words.

Each is a verifiers plugin module (`__all__` exports its `Taskset`, the in-process
`LocalChatHarness` and, where it has one, its `Env`). verifiers resolves a plugin id by
importing it as a top-level module, so a dotted module path cannot be an id; `plugin_id`
gives each module an id and `register_plugin` aliases it in `sys.modules` under that id,
in every process that loads the env (orchestrator, env server, pool workers).

Importing this package is cheap (it does not import verifiers).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

BUILTIN_ENVS = {
    "reverse_text": "jaxrl.envs.reverse_text",
    "alphabet_sort": "jaxrl.envs.alphabet_sort",
    "lookup": "jaxrl.envs.lookup",
    "reverse_duel": "jaxrl.envs.reverse_duel",
    "needle": "jaxrl.envs.needle",
}
"""Built-in env name -> the module that implements it."""

LOCAL_HARNESS = ("jaxrl_local_chat", "jaxrl.envs.harness")
"""(verifiers plugin id, module) of `LocalChatHarness`: the harness of every agent seat whose
taskset ships none and whose config names none (verifiers' own default, `bash`, installs a
program over the network at run time; this one runs offline, in the env-server process)."""


def plugin_id(env_id: str) -> tuple[str, str | None]:
    """The verifiers taskset id for a configured env id, and the module to alias under it.

    A built-in name maps to its module; a dotted path (`my_pkg.my_env`) is a module that
    exports a Taskset; anything else is an installed verifiers taskset id, used as is.
    """
    if env_id in BUILTIN_ENVS:
        return f"jaxrl_{env_id}", BUILTIN_ENVS[env_id]
    if "." in env_id:
        return "jaxrl_" + env_id.replace(".", "_").lower(), env_id
    return env_id, None


def check_env_id(env_id: str) -> None:
    """Raise a ValueError naming the fix when `env_id` names no importable environment.

    Cheap: finds the module without importing it (only a dotted path's parents import).
    """
    if env_id in BUILTIN_ENVS:
        return
    name = env_id if "." in env_id else env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    found = False
    for candidate in (name, f"verifiers.v1.tasksets.{name}"):  # verifiers' own built-ins last
        try:
            found = found or importlib.util.find_spec(candidate) is not None
        except (ImportError, ValueError):
            pass
    if not found:
        raise ValueError(
            f"unknown env id {env_id!r}: not a built-in ({', '.join(sorted(BUILTIN_ENVS))}), "
            "not an importable module path, and no installed verifiers environment of that name; "
            "install the environment package or fix the id"
        )


def register_plugin(verifiers_id: str, module_path: str) -> None:
    """Alias `module_path` in `sys.modules` under `verifiers_id`, so verifiers' loader finds it."""
    if verifiers_id not in sys.modules:
        sys.modules[verifiers_id] = importlib.import_module(module_path)
