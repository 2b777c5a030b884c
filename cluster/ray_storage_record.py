"""The L3 a replica's head has attached, persisted outside the head actor so a restarted head re-attaches it.

A head actor restart (Ray ``max_restarts``) re-runs the constructor: everything in the actor's memory,
including an ``attach_storage_backend`` made at runtime, is gone. The head therefore writes its
attachment, each time it changes, to Ray's internal key-value store (in the GCS, namespace
``hicache``, key ``storage/<replica>``) and a restarted incarnation reads it back.

Why the internal KV: it lives in the GCS, which also holds the named head actor and drives its
restart, so the record is there whenever a restarted head can be; it is one call with a timeout and
needs no process of its own (a named "record keeper" actor would be one more thing that can die,
restart empty, or outlive its replica). It is Ray's internal API (``ray.experimental.internal_kv``),
the one Ray's own libraries use for such records.

Who calls: only the head actor's threads (``attached`` when an incarnation starts, ``remember`` on
each change) and ``stop_replica`` (``forget``). Values are pickled ``Attached`` records: ``params``
None means "explicitly detached" (a restart must not attach the start configuration's L3 again);
no record means the head never ran, or was stopped.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

from ray.experimental.internal_kv import internal_kv_get_gcs_client

from hicache.cluster.errors import HiCacheUnavailableError
from hicache.cluster.storage_tier import StorageParams

NAMESPACE = b"hicache"
TIMEOUT_S = 10.0  # every GCS call is bounded


@dataclass(frozen=True)
class Attached:
    params: StorageParams | None  # None: detached on purpose


def _key(replica: str) -> bytes:
    return f"storage/{replica}".encode()


def _gcs():
    gcs = internal_kv_get_gcs_client()
    if gcs is None:
        raise HiCacheUnavailableError("Ray is not initialized in this process (no GCS client)")
    return gcs


def remember(replica: str, params: StorageParams | None, timeout_s: float = TIMEOUT_S) -> None:
    """Records ``params`` (None: detached) as the L3 attachment of ``replica``."""
    value = pickle.dumps(Attached(params), protocol=pickle.HIGHEST_PROTOCOL)
    _gcs().internal_kv_put(_key(replica), value, True, NAMESPACE, timeout=timeout_s)


def attached(replica: str, timeout_s: float = TIMEOUT_S) -> Attached | None:
    """The recorded attachment of ``replica``; None when there is no record."""
    value = _gcs().internal_kv_get(_key(replica), NAMESPACE, timeout=timeout_s)
    return None if value is None else pickle.loads(value)


def forget(replica: str, timeout_s: float = TIMEOUT_S) -> None:
    _gcs().internal_kv_del(_key(replica), False, NAMESPACE, timeout=timeout_s)
