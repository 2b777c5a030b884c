"""Exceptions a remote ``CacheClient`` raises instead of Ray's (``hicache.cluster.ray_client``).

Call errors of the cache itself keep their builtin types (``ValueError`` for bad ids, ``TypeError``,
``CacheCapacityError``); these classes only say that the *replica* could not answer:

* ``HiCacheTimeoutError``: no answer within the client's timeout. The call may still be applied
  later: treat the request it belongs to as failed.
* ``HiCacheUnavailableError``: the head is gone, restarting, or rebuilding its host workers.
* ``HiCacheDrainingError``: the replica got a preemption notice and admits no new request
  (``hicache.cluster.drain``); send it to another replica.
* ``HiCacheReplicaResetError``: the replica lost its cached state (head restart or lost host worker)
  since this client last talked to it. Every node id and page a request obtained before is void:
  drop in-flight requests (do not free/unlock them) and start them over.
"""

from __future__ import annotations


class HiCacheError(Exception):
    """Base class of the cluster errors."""


class HiCacheTimeoutError(HiCacheError, TimeoutError):
    pass


class HiCacheUnavailableError(HiCacheError, ConnectionError):
    pass


class HiCacheDrainingError(HiCacheError, RuntimeError):
    """Raised by ``begin_request`` while the replica drains (a per-call error of a step)."""


class HiCacheReplicaResetError(HiCacheUnavailableError):
    def __init__(self, replica: str, old_epoch: int | None, new_epoch: int | None, reason: str = "") -> None:
        self.replica, self.old_epoch, self.new_epoch, self.reason = replica, old_epoch, new_epoch, reason
        super().__init__(
            f"replica {replica!r} was reset (epoch {old_epoch} -> {new_epoch}{': ' + reason if reason else ''}); "
            "node ids and pages obtained before are void: restart in-flight requests"
        )

    def __reduce__(self):  # picklable across Ray
        return (type(self), (self.replica, self.old_epoch, self.new_epoch, self.reason))
