"""Transfer plans and acks: the contract between the head (decides) and the host workers (execute).

The head sends the same ``TransferPlan`` to every host worker of a replica; each worker executes plans
strictly in ``seq`` order and answers one ``TransferAck`` per op. Page and slot ids are plain int32
numpy arrays: no ``jax.Array`` ever crosses a process (Ray) boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np


class OpKind(str, Enum):
    BACKUP_D2H = "d2h"  # L1 pages -> L2 slots
    LOAD_H2D = "h2d"  # L2 slots -> L1 pages
    BACKUP_H2S = "h2s"  # L2 slots -> L3 objects
    PREFETCH_S2H = "s2h"  # L3 objects -> L2 slots


@dataclass(frozen=True, eq=False)
class TransferOp:
    op_id: int
    kind: OpKind
    device_pages: np.ndarray  # i32[n] (empty for storage ops)
    host_slots: np.ndarray  # i32[n]
    storage_keys: tuple[str, ...] = ()  # chain keys, storage ops only


@dataclass(frozen=True, eq=False)
class TransferPlan:
    seq: int
    ops: tuple[TransferOp, ...]


@dataclass(frozen=True)
class TransferAck:
    seq: int
    op_id: int
    host: int
    ok: bool
    error: str | None
    bytes_moved: int
    duration_s: float
