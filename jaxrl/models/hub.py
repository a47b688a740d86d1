"""``[model] name`` -> a local Hugging Face model directory: a directory as given, a hub id fetched.

(``fetch_snapshot`` serves ``[data] path`` dataset ids the same way.)

A name that is not an existing directory but is a valid hub id (``org/name``) is fetched with
``huggingface_hub.snapshot_download`` into the standard HF cache, so ``HF_HOME`` /
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` behave exactly as they do for
transformers. Only what jaxrl reads is fetched (``MODEL_FILES``): safetensors weights, configs,
tokenizer files and the chat template, never PyTorch/GGUF/ONNX copies of the weights.

Multi-host: process 0 fetches first while the others wait at a barrier, then every other
process calls ``snapshot_download`` too. On shared storage (one cache for the slice) that second
call finds the files and downloads nothing; with a cache per host it fetches that host's copy
(once per host: processes of one host share its cache and its file locks).
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxrl.compat import hub_snapshot_download
from jaxrl.parallel.distributed import barrier

MODEL_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files a snapshot brings: weights (safetensors only), configs, tokenizer, chat template."""


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is shaped like a hub repo id (``org/name`` or ``name``)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model_dir(name: str, revision: str | None = None) -> Path:
    """The local directory of model ``name``: itself if it is a directory, else its hub snapshot.

    Raises ``FileNotFoundError`` naming the id and the cache path when the model is neither a
    directory nor fetchable (offline with no cached copy, unknown repo, gated without a token).
    """
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"model.revision = {revision!r} applies to hub ids; model.name = {name!r} is a directory")
        return path
    if not is_hub_id(name):
        raise FileNotFoundError(
            f"model.name = {name!r}: no such directory, and not a Hugging Face hub id (org/name). "
            "Point it at a model directory (config.json + *.safetensors) or a hub id"
        )
    return fetch_snapshot(name, revision, repo_type="model", allow_patterns=list(MODEL_FILES), field="model.name")


def fetch_snapshot(repo_id: str, revision: str | None, *, repo_type: str, allow_patterns: list[str], field: str) -> Path:
    """The local snapshot of a hub repo (model or dataset): process 0 fetches first, then the rest."""
    if jax.process_index() == 0:
        local = _fetch(repo_id, revision, repo_type, allow_patterns, field)
        barrier(f"jaxrl-hub-fetch-{repo_type}-{repo_id}")
    else:
        barrier(f"jaxrl-hub-fetch-{repo_type}-{repo_id}")
        local = _fetch(repo_id, revision, repo_type, allow_patterns, field)
    if repo_type == "model" and not (local / "config.json").exists():
        raise FileNotFoundError(f"{field} = {repo_id!r}: the snapshot at {local} has no config.json")
    return local


def _fetch(repo_id: str, revision: str | None, repo_type: str, allow_patterns: list[str], field: str) -> Path:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    cache = constants.HF_HUB_CACHE
    rev_field = field.rsplit(".", 1)[0] + ".revision"
    try:
        return hub_snapshot_download(repo_id, revision=revision, repo_type=repo_type, allow_patterns=allow_patterns)
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise FileNotFoundError(
            f"{field} = {where!r}: {why} and there is no cached copy in {cache} "
            f"({repo_type}s--{repo_id.replace('/', '--')}). Download it once online "
            f"(`hf download {repo_id}{' --repo-type dataset' if repo_type == 'dataset' else ''}`), point HF_HOME / "
            f"HF_HUB_CACHE at a cache that has it, or set {field} to a local path"
        ) from e
    except GatedRepoError as e:
        raise FileNotFoundError(f"{field} = {where!r} is gated: accept its licence on huggingface.co and set HF_TOKEN") from e
    except RevisionNotFoundError as e:
        raise FileNotFoundError(f"{rev_field} = {revision!r}: no such revision of {repo_id!r}") from e
    except RepositoryNotFoundError as e:
        raise FileNotFoundError(
            f"{field} = {where!r}: no such {repo_type} repo on the hub (or it is private and HF_TOKEN is unset)"
        ) from e
