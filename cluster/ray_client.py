"""``connect``: a ``CacheClient`` whose calls go to a replica's head actor through Ray.

Runs in the serving process (once per scheduler). Every remote call has a timeout; Ray's errors
become ``hicache.cluster.errors`` exceptions; a batched ``step`` (and a single call: a step of one)
is one round trip in the compact wire format of ``hicache.cluster.wire`` (a match key that extends
one this client sent before travels as a reference plus its new tokens: ``key_history``). The transport
remembers the head's epoch and sends it with every call: after a head restart or a lost host the
head refuses calls from the old epoch once (``HiCacheReplicaResetError``), so stale node ids and
pages are never applied to the new state. Not thread-safe: one transport per scheduler thread.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import ray

from hicache.cluster import wire
from hicache.cluster.client import CacheClient
from hicache.cluster.errors import HiCacheError, HiCacheReplicaResetError, HiCacheTimeoutError, HiCacheUnavailableError
from hicache.cluster.head import Call, CallResult
from hicache.cluster.key_history import DEFAULT_CAP_TOKENS, SentKeys
from hicache.cluster.ray_head import NAMESPACE, Reply, get_head

_CHUNK = 90_000  # below Ray's max_direct_call_object_size (100 KB): arguments travel inline


class RayTransport:
    def __init__(self, head: Any, replica: str, timeout_s: float = 30.0,
                 history_tokens: int = DEFAULT_CAP_TOKENS) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.head = head
        self.replica = replica
        self.timeout_s = float(timeout_s)
        self.epoch: int | None = None  # last epoch the head answered from
        self._sent = SentKeys(history_tokens)  # match keys the head holds for this client

    def _remote(self, method: str, *args: Any) -> Reply:
        try:
            ref = getattr(self.head, method).remote(self.epoch, *args)
            reply: Reply = ray.get(ref, timeout=self.timeout_s)
            if isinstance(reply, bytes):
                reply = pickle.loads(reply)
        except ray.exceptions.GetTimeoutError:
            raise HiCacheTimeoutError(
                f"replica {self.replica!r}: {method} got no answer within {self.timeout_s}s (it may still be applied)"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.RaySystemError) as e:
            raise HiCacheUnavailableError(f"replica {self.replica!r}: head unreachable: {type(e).__name__}") from e
        except ray.exceptions.RayTaskError as e:
            raise HiCacheError(f"replica {self.replica!r}: {method} failed in the head: {e}") from e
        if reply.status in ("ok", "resync"):
            self.epoch = reply.epoch
            return reply
        if reply.status == "reset":
            old, self.epoch = self.epoch, reply.epoch
            raise HiCacheReplicaResetError(self.replica, old, reply.epoch, reply.reason)
        raise HiCacheUnavailableError(reply.reason or f"replica {self.replica!r} is unavailable")

    def call(self, call: Call) -> Any:
        return self.step([call])[0].unwrap()

    def step(self, calls: Sequence[Call]) -> list[CallResult]:
        calls = list(calls)
        for _ in range(2):  # the second try starts a new key history: the head cannot ask to resync it
            sent = self._sent
            header, buf, keys = wire.encode_calls(calls, sent)
            request = (sent.session, sent.steps, sent.cap_tokens, header, buf)
            blob = memoryview(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
            chunks = [blob[i : i + _CHUNK].tobytes() for i in range(0, len(blob), _CHUNK)]
            try:
                reply = self._remote("step_wire", *chunks)
            except BaseException:  # the head may or may not have run it: its key history is unknown
                self._sent = SentKeys(sent.cap_tokens)
                raise
            if reply.status == "ok":
                sent.commit_copies(keys)
                return wire.decode_results(*reply.results, calls)
            self._sent = SentKeys(sent.cap_tokens)
        raise HiCacheError(f"replica {self.replica!r}: the head refused a new key-history session")


def connect(replica: str = "default", address: str | None = None, *, timeout_s: float = 30.0) -> CacheClient:
    """A client for the running replica ``replica`` (started with ``start_replica``).

    Joins the Ray cluster at ``address`` (default ``"auto"``) if this process is not connected yet.
    """
    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace=NAMESPACE)
    head = get_head(replica)
    try:
        health = ray.get(head.health.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise HiCacheTimeoutError(f"replica {replica!r}: no health answer within {timeout_s}s") from None
    except ray.exceptions.RayActorError as e:
        raise HiCacheUnavailableError(f"replica {replica!r}: head unreachable: {type(e).__name__}") from e
    return CacheClient(RayTransport(head, replica, timeout_s), health.page_size)
