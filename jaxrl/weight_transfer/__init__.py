"""Trainer -> server weight transfer at network speed (issue 40), with no gather and no files.

Every trainer process serves the shards it holds of each new version (``Publisher``); a server
pulls exactly the pieces its own layout needs (``plan_pulls``, from the ``Manifest``) straight
into its device buffers (``pull_weights``), group by group, and swaps them in as one state.
Bytes travel over a ``Transport``: raw TCP (``"tcp"``) or ``jax.experimental.transfer``
(``"jax"``), picked by measurement (bench/weight_transfer.py).

    trainer process i:  pub = Publisher(); fragment_i = pub.publish(step, params)
    process 0:          manifest = merge_manifests(fragments)  (or manifest_for(step, params, addresses, dtype))
    each server:        state = pull_weights(manifest, engine_abstract_state); engine swaps it in

With ``Publisher(delta=True)`` a version may be published as a delta against the one before it
(``Manifest.base_version``): a server holding exactly that base pulls only the changed blocks
(``delta.py``; the per-element loops compiled with numba, ``delta_loops.py``, imported when a
delta is first made or applied), any other pulls the version whole.

This package builds on ``jax``, numpy and (for deltas) numba only (no jaxrl module but its
own): the trainer and the engine each use it without knowing the other.
"""

from jaxrl.weight_transfer.base import VersionUnavailable, WeightTransferError
from jaxrl.weight_transfer.host_buffers import HostBufferPool
from jaxrl.weight_transfer.manifest import Manifest, ParamEntry, Shard, manifest_for, merge_manifests
from jaxrl.weight_transfer.plan import Plan, Pull, TargetPiece, plan_pulls
from jaxrl.weight_transfer.publisher import Changes, Publisher
from jaxrl.weight_transfer.puller import PullError, applies_as_delta, pull_weights
from jaxrl.weight_transfer.transport import get_transport

__all__ = [
    "Changes",
    "HostBufferPool",
    "Manifest",
    "ParamEntry",
    "Plan",
    "Publisher",
    "Pull",
    "PullError",
    "Shard",
    "TargetPiece",
    "VersionUnavailable",
    "WeightTransferError",
    "applies_as_delta",
    "get_transport",
    "manifest_for",
    "merge_manifests",
    "plan_pulls",
    "pull_weights",
]
