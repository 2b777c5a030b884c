"""Engine adapters: the model as the ``Scheduler`` sees it, wherever it runs (DESIGN.md §1).

The ``Scheduler`` drives an ``Engine``; every engine call
forwards over the replica's L1 pool, wherever that pool lives:

* ``ModelRunner`` itself (L1 only, embedded): the runner owns its pool; nothing else touches it.
* ``WorkerEngine`` (embedded HiCache): the model sits inside the ``HostWorker``, which owns the L1
  array and lends it to the model for each call (``HostWorker.run_model``), on this one thread; any
  transfer a cache call dispatches therefore reads or writes the array the last forward produced.
* ``hicache.reference.ray_engine.RayEngine`` (a Ray replica): the model sits inside every host's
  ``HostWorkerActor`` and runs SPMD over the replica's sharded L1 pool; each call goes to every host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from hicache.reference.engine import batched
from hicache.reference.engine.runner import Generation, TokenIds, greedy_decode


class Engine(Protocol):
    """The model as the scheduler sees it (``ModelRunner`` methods of the same names and meaning)."""

    @property
    def page_size(self) -> int: ...

    def extend(self, tokens: TokenIds, page_table: TokenIds, start_pos: int) -> np.ndarray: ...

    def prefill(self, tokens: TokenIds, page_table: TokenIds, start_pos: int,
                state_slot: int | None = None, swa_table: TokenIds | None = None) -> np.ndarray: ...

    def decode(self, tokens: TokenIds, last_logits: np.ndarray, page_table: TokenIds,
               max_new_tokens: int, *, between_steps: Callable[[], None] | None = None,
               state_slot: int | None = None, swa_table: TokenIds | None = None,
               track_slot: int | None = None) -> Generation: ...

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None: ...

    def zero_states(self, slots: Sequence[int]) -> None: ...

    def decode_step(self, tokens: TokenIds, page_table: TokenIds, state_slot: int | None = None,
                    swa_table: TokenIds | None = None, track_slot: int | None = None) -> np.ndarray: ...

    def generate_no_cache(self, tokens: TokenIds, max_new_tokens: int) -> Generation: ...


def _extra(state_slot: int | None, swa_table: TokenIds | None, track_slot: int | None = None) -> tuple[Any, ...]:
    """The trailing (state slot, SWA table[, track slot]) arguments of a model call: none for a Full-only model."""
    if track_slot is not None:
        return state_slot, swa_table, track_slot
    return () if state_slot is None and swa_table is None else (state_slot, swa_table)


class RemoteModelEngine(ABC):
    """An ``Engine`` whose model lives elsewhere (a worker) and is reached by ``call(method, *args)``."""

    page_size: int

    @abstractmethod
    def call(self, method: str, *args: Any) -> Any:
        """``model.<method>(*args)`` where the model lives, over the L1 array; returns its result."""

    def extend(self, tokens: TokenIds, page_table: TokenIds, start_pos: int) -> np.ndarray:
        return self.call("extend", tokens, page_table, start_pos)

    def prefill(self, tokens: TokenIds, page_table: TokenIds, start_pos: int,
                state_slot: int | None = None, swa_table: TokenIds | None = None) -> np.ndarray:
        return self.call("prefill", tokens, page_table, start_pos, *_extra(state_slot, swa_table))

    def decode(self, tokens: TokenIds, last_logits: np.ndarray, page_table: TokenIds,
               max_new_tokens: int, *, between_steps: Callable[[], None] | None = None,
               state_slot: int | None = None, swa_table: TokenIds | None = None,
               track_slot: int | None = None) -> Generation:
        """One call for the whole decode; with ``between_steps``, one call per step and the hook between
        them, here (it may call the cache, which may transfer over L1: never inside a model call). The
        track slot's page-end copies run inside those model calls (``ModelRunner.decode_step``)."""
        if between_steps is None:
            extra = _extra(state_slot, swa_table, track_slot)
            return self.call("decode", tokens, last_logits, page_table, max_new_tokens, *((None, None) if extra else ()),
                             *extra)
        return greedy_decode(lambda seq: self.decode_step(seq, page_table, state_slot, swa_table, track_slot), tokens,
                             last_logits, max_new_tokens, between_steps=between_steps)

    def decode_step(self, tokens: TokenIds, page_table: TokenIds, state_slot: int | None = None,
                    swa_table: TokenIds | None = None, track_slot: int | None = None) -> np.ndarray:
        return self.call("decode_step", tokens, page_table, *_extra(state_slot, swa_table, track_slot))

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        self.call("copy_states", copies)

    def zero_states(self, slots: Sequence[int]) -> None:
        self.call("zero_states", slots)

    def decode_steps(self, seqs: Sequence[TokenIds], tables: Sequence[TokenIds]) -> list[np.ndarray]:
        """``decode_step`` for each request (one call each; an engine whose model runs in this process
        does it in one dispatch)."""
        return [self.decode_step(s, t) for s, t in zip(seqs, tables)]

    def compile_decode_batches(self, max_batch: int) -> None:
        """Compiles what ``decode_steps`` runs for up to ``max_batch`` requests (nothing here)."""

    def generate_no_cache(self, tokens: TokenIds, max_new_tokens: int) -> Generation:
        """The reference: the same model, same pool shape and sharding, nothing reused."""
        return self.call("generate_no_cache", tokens, max_new_tokens)


class WorkerEngine(RemoteModelEngine):
    """The model inside an in-process ``HostWorker`` (its ``attach_model``): each call borrows the
    worker's L1 array on this thread (``run_model``)."""

    def __init__(self, worker) -> None:  # hicache.workers.HostWorker with a model attached
        if worker.model is None:
            raise ValueError(f"host worker {worker.host_index} has no model attached")
        self.worker = worker
        self.page_size = int(worker.model.fwd.page_size)

    def call(self, method: str, *args: Any) -> Any:
        fn: Callable = lambda model: getattr(model, method)(*args)  # noqa: E731
        return self.worker.run_model(fn)

    def decode(self, tokens: TokenIds, last_logits: np.ndarray, page_table: TokenIds,
               max_new_tokens: int, *, between_steps: Callable[[], None] | None = None,
               state_slot: int | None = None, swa_table: TokenIds | None = None,
               track_slot: int | None = None) -> Generation:
        """As ``RemoteModelEngine.decode``, the request checked once (``ModelRunner.decoder``: no pool
        touched), not at every step; each step one model call, the hook between them."""
        if between_steps is None:
            return super().decode(tokens, last_logits, page_table, max_new_tokens, state_slot=state_slot,
                                  swa_table=swa_table, track_slot=track_slot)
        step = self.worker.model.decoder(tokens, page_table, max_new_tokens, state_slot, swa_table, track_slot)
        return greedy_decode(lambda seq: self.worker.run_model(lambda _: step(seq)), tokens, last_logits,
                             max_new_tokens, between_steps=between_steps)

    def decode_steps(self, seqs: Sequence[TokenIds], tables: Sequence[TokenIds]) -> list[np.ndarray]:
        """One model call, one dispatch (``hicache.reference.engine.batched.decode_steps``), bit-identical."""
        return self.worker.run_model(lambda model: batched.decode_steps(model, seqs, tables))

    def compile_decode_batches(self, max_batch: int) -> None:
        self.worker.run_model(lambda model: batched.compile_batches(model, max_batch))
