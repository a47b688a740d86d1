"""Differences between the dependency versions jaxrl supports, in one place.

jaxrl runs on Python 3.11 (jax 0.10.x) and 3.12 (jax 0.11.2 beside vllm-tpu, up to 0.12.x), with
transformers 5.16.1+ and whichever ``huggingface_hub`` that transformers brings (1.x with
transformers 5.17, the CUDA image's set; 2.x with the newest). Between jax 0.10.2, 0.11.2 and
0.12.0.1 the suite found no API difference jaxrl uses; what differs is listed here, each with the
versions it is for, so the rest of the code never checks a version.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_snapshot_download(repo_id: str, *, revision: str | None, repo_type: str, **kwargs: Any) -> Path:
    """``huggingface_hub.snapshot_download`` with the offline behaviour of huggingface_hub 2.x.

    huggingface_hub 1.x, asked for a full commit hash that is already in the cache, lists the
    repo's tree on the hub first; with ``HF_HUB_OFFLINE`` set that raises
    ``OfflineModeIsEnabled`` instead of using the cached snapshot (2.x returns the snapshot).
    Offline, a cached commit is returned as 2.x does; any other offline miss is raised as
    ``LocalEntryNotFoundError``, the one error callers handle for "not in the cache".
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE and revision is not None and _COMMIT.fullmatch(revision):
        cache = Path(kwargs.get("cache_dir") or constants.HF_HUB_CACHE)
        snapshot = cache / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots" / revision
        if snapshot.is_dir():
            return snapshot
    try:
        return Path(snapshot_download(repo_id, revision=revision, repo_type=repo_type, **kwargs))
    except OfflineModeIsEnabled as e:
        raise LocalEntryNotFoundError(str(e)) from e
