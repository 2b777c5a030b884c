"""Transfer plans and acks: the only data the control plane (head) and the workers exchange.

Plain numpy/int/str data (no ``jax.Array``): these cross Ray boundaries. The head builds one
``TransferPlan`` per step and sends the *same* plan to every host of a replica; each host's
``HostWorker`` executes it on its own shards (its KV heads) and answers one ``TransferAck`` per op.
``device_pages`` are global L1 page ids (identical on every host); ``host_slots`` are L2 slot ids,
allocated by the head and identical on every host (each host stores its heads of the page there).
A hybrid model's other pools (e.g. the sliding-window layers' KV pool, ``"swa"``) ride in the same D2H /
H2D op as ``PoolCopy`` entries (``TransferOp.pools``): one op, one ack per host for every pool, so a
copy's state changes on the head only when every pool's part of it is done on every host.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from hicache.storage.keys import check_key


class OpKind(str, enum.Enum):
    BACKUP_D2H = "d2h"  # L1 pages -> L2 slots
    LOAD_H2D = "h2d"  # L2 slots -> L1 pages
    BACKUP_H2S = "h2s"  # L2 slots -> L3 objects (storage_keys, one per slot)
    PREFETCH_S2H = "s2h"  # L3 objects -> L2 slots


def _as_id_array(value: object, name: str) -> np.ndarray:
    if type(value) is np.ndarray and value.dtype == np.int32 and value.ndim == 1:
        arr = value.copy()  # the common case (ids from the head's allocators): nothing to check
        arr.setflags(write=False)
        return arr
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(np.int32)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"TransferOp.{name} must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"TransferOp.{name} must be 1-D, got shape {arr.shape}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise ValueError(f"TransferOp.{name} does not fit int32: {arr.tolist()[:8]}")
    arr = arr.astype(np.int32)  # a private copy
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False, slots=True)
class PoolCopy:
    """The part of a D2H / H2D op that moves pages of a component pool (``pool``: its name, e.g. "swa");
    ids are that pool's own (its device pages, its host slots), paired positionally."""

    pool: str
    device_pages: np.ndarray  # i32[n]
    host_slots: np.ndarray  # i32[n]

    def __post_init__(self) -> None:
        if not isinstance(self.pool, str) or not self.pool or self.pool == MAIN_POOL:
            raise ValueError(f"PoolCopy.pool must name a component pool (not {MAIN_POOL!r}), got {self.pool!r}")
        object.__setattr__(self, "device_pages", _as_id_array(self.device_pages, "device_pages"))
        object.__setattr__(self, "host_slots", _as_id_array(self.host_slots, "host_slots"))
        if self.device_pages.size != self.host_slots.size:
            raise ValueError(f"pool {self.pool!r}: {self.device_pages.size} device_pages vs "
                             f"{self.host_slots.size} host_slots")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PoolCopy):
            return NotImplemented
        return self.pool == other.pool and np.array_equal(self.device_pages, other.device_pages) and np.array_equal(
            self.host_slots, other.host_slots)

    __hash__ = None  # type: ignore[assignment]


MAIN_POOL = "kv"  # the Full attention KV pool: ``TransferOp.device_pages`` / ``host_slots`` themselves


@dataclass(frozen=True, eq=False, slots=True)
class StoragePart:
    """The part of an L2<->L3 op (H2S / S2H) that moves the values of one node end of a component pool (``pool``:
    e.g. "mamba", the state at the end; "swa", the window's pages before it) as ONE object of that pool: its pages
    ``first_page .. first_page + n - 1`` of the chain, held in that pool's L2 slots ``host_slots`` (``n`` of them),
    named ``key``: the chain key of its last page (the end), which also fixes ``n`` for the values a pool keeps at
    an end (see ``hicache.cluster.storage_components``)."""

    pool: str
    first_page: int
    key: str
    host_slots: np.ndarray  # i32[n], n >= 1

    def __post_init__(self) -> None:
        if not isinstance(self.pool, str) or not self.pool or self.pool == MAIN_POOL:
            raise ValueError(f"StoragePart.pool must name a component pool (not {MAIN_POOL!r}), got {self.pool!r}")
        if isinstance(self.first_page, bool) or not isinstance(self.first_page, (int, np.integer)) or self.first_page < 0:
            raise ValueError(f"StoragePart.first_page must be an int >= 0, got {self.first_page!r}")
        check_key(self.key, what=f"pool {self.pool!r} key")
        object.__setattr__(self, "host_slots", _as_id_array(self.host_slots, "storage part host_slots"))
        if not self.host_slots.size:
            raise ValueError(f"pool {self.pool!r}: a storage part moves at least one page")

    @property
    def num_pages(self) -> int:
        return int(self.host_slots.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StoragePart):
            return NotImplemented
        return (self.pool, self.first_page, self.key) == (other.pool, other.first_page, other.key) and \
            np.array_equal(self.host_slots, other.host_slots)

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False, slots=True)
class TransferOp:
    """One copy between tiers. Pairs are positional: ``device_pages[i] <-> host_slots[i]``
    (and ``host_slots[i] <-> storage_keys[i]`` for storage ops)."""

    op_id: int
    kind: OpKind
    device_pages: np.ndarray  # i32[n]; empty for storage ops
    host_slots: np.ndarray  # i32[n]
    storage_keys: tuple[str, ...] = ()
    first_page: int = 0  # storage ops: chain index of the first key (chunk layout of L3 objects)
    pools: tuple[PoolCopy, ...] = ()  # D2H / H2D: the same copy's pages of component pools (one per pool)
    # a fetch (S2H) whose first_page lies inside an L3 object's chunk: the chain key of that chunk's first
    # page, so storage can find the chunk's objects by it (``PoolTransfer.chunk_start_key``)
    chunk_start_key: str | None = None
    # H2S / S2H of a hybrid model: the same op's pages of component pools (one ack for every pool: a fetch is
    # committed, or fails, whole)
    storage_parts: tuple[StoragePart, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", OpKind(self.kind))
        object.__setattr__(self, "storage_parts", tuple(self.storage_parts))
        for part in self.storage_parts:
            if not isinstance(part, StoragePart):
                raise TypeError(f"TransferOp.storage_parts must hold StoragePart, got {type(part).__name__}")
        if self.storage_parts and self.kind not in (OpKind.BACKUP_H2S, OpKind.PREFETCH_S2H):
            raise ValueError(f"op {self.op_id}: storage parts in a {self.kind.value} op (H2S/S2H only)")
        if self.chunk_start_key is not None:
            check_key(self.chunk_start_key, what=f"op {self.op_id}: chunk_start_key")
        object.__setattr__(self, "pools", tuple(self.pools))
        names = []
        for copy in self.pools:
            if not isinstance(copy, PoolCopy):
                raise TypeError(f"TransferOp.pools must hold PoolCopy, got {type(copy).__name__}")
            names.append(copy.pool)
        if len(set(names)) != len(names):
            raise ValueError(f"op {self.op_id}: a pool appears twice in {names}")
        if names and self.kind not in (OpKind.BACKUP_D2H, OpKind.LOAD_H2D):
            raise ValueError(f"op {self.op_id}: component pools {names} in a {self.kind.value} op (D2H/H2D only)")
        object.__setattr__(self, "device_pages", _as_id_array(self.device_pages, "device_pages"))
        object.__setattr__(self, "host_slots", _as_id_array(self.host_slots, "host_slots"))
        object.__setattr__(self, "storage_keys", tuple(self.storage_keys))
        if isinstance(self.op_id, bool) or not isinstance(self.op_id, (int, np.integer)):
            raise TypeError(f"TransferOp.op_id must be an int, got {self.op_id!r}")
        if isinstance(self.first_page, bool) or not isinstance(self.first_page, (int, np.integer)) or self.first_page < 0:
            raise ValueError(f"TransferOp.first_page must be an int >= 0, got {self.first_page!r}")
        if self.kind in (OpKind.BACKUP_D2H, OpKind.LOAD_H2D):
            if self.device_pages.size != self.host_slots.size:
                raise ValueError(
                    f"op {self.op_id}: {self.device_pages.size} device_pages vs "
                    f"{self.host_slots.size} host_slots"
                )
        elif len(self.storage_keys) != self.host_slots.size:
            raise ValueError(
                f"op {self.op_id}: {len(self.storage_keys)} storage_keys vs {self.host_slots.size} host_slots"
            )

    @classmethod
    def copy_op(cls, op_id: int, kind: OpKind, device_pages: np.ndarray, host_slots: np.ndarray,
                pools: tuple[PoolCopy, ...] = ()) -> TransferOp:
        """An L1<->L2 copy op from ids the caller owns and trusts: the head's own ``int32`` 1-D arrays, of
        equal length, never written in place after (its allocators and nodes replace arrays, they never
        write into them). Built without the checks and private copies of the constructor (one op per sent
        batch, each a few hundred ids); whatever arrives from elsewhere (tests, callers of a worker, a plan
        off the wire) still goes through ``TransferOp(...)``, and the worker checks every id of a plan."""
        op = object.__new__(cls)
        for name, value in (("op_id", op_id), ("kind", kind), ("device_pages", device_pages),
                            ("host_slots", host_slots), ("storage_keys", ()), ("first_page", 0), ("pools", pools),
                            ("chunk_start_key", None), ("storage_parts", ())):
            object.__setattr__(op, name, value)  # the frozen class's own way to set a field
        return op

    @property
    def num_pages(self) -> int:
        return int(self.host_slots.size)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TransferOp):
            return NotImplemented
        return (self.op_id, self.kind, self.storage_keys, self.pools, self.storage_parts) == (
            other.op_id, other.kind, other.storage_keys, other.pools, other.storage_parts) and (
            np.array_equal(self.device_pages, other.device_pages) and np.array_equal(self.host_slots, other.host_slots)
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class TransferPlan:
    """Ops executed strictly in order; ``seq`` strictly increases per worker."""

    seq: int
    ops: tuple[TransferOp, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if isinstance(self.seq, bool) or not isinstance(self.seq, (int, np.integer)):
            raise TypeError(f"TransferPlan.seq must be an int, got {self.seq!r}")
        ids = [op.op_id for op in self.ops]
        if len(set(ids)) != len(ids):
            raise ValueError(f"plan {self.seq}: duplicate op_id in {ids}")
        for op in self.ops:
            if not isinstance(op, TransferOp):
                raise TypeError(f"plan {self.seq}: ops must be TransferOp, got {type(op).__name__}")


@dataclass(frozen=True)
class TransferAck:
    """Outcome of one op on one host. ``ok=False`` means neither pool was changed by it."""

    seq: int
    op_id: int
    host: int
    ok: bool
    error: str | None
    bytes_moved: int
    duration_s: float
