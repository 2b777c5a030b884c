"""``ModelRunner``: params + the L1 KV pool + the chunk loop, for one process that owns a device.

Ownership: the runner owns ``params`` and, between forwards, the L1 pool ``kv_pool`` (layout in
``hicache.reference.engine.kv_layout``, the same array the data plane's paged-copy kernels move). Each forward
donates the pool and the runner rebinds to the returned array, so nobody else may keep a reference
across a forward. The data plane reads or writes L1 between forwards on the same thread: take
``runner.pool``, transfer (donating it), hand the result back with ``runner.set_pool(kv)``. On a
TPU host the runner lives inside the HostWorker process (DESIGN.md §1) and takes that worker's L1
array, sharded on the KV-head axis (``ModelRunner(..., pool=...)``); in the embedded default it is a
plain object with its own pool.

Page ownership is *not* the runner's: the caller (scheduler / cache head) allocates pages and passes
each request's page table (page ids in position order). The runner validates it and writes exactly the
slots of the positions it computes. Pages of a reused prefix are only read.

Typical scheduler use (``hit`` = cached prefix length from the cache, page-aligned)::

    start = prefill_start(hit, len(prompt), page_size)  # at least one token is computed
    logits = runner.prefill(prompt, page_table, start_pos=start)
    gen = runner.decode(prompt, logits, page_table, max_new_tokens=8)
    # or step by step, interleaving requests: runner.decode_step(seq, page_table) -> logits

Every forward is one fixed-shape chunk (see ``hicache.reference.engine.model`` for why this makes cached and
recomputed KV bit-identical).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from hicache.reference.engine import kv_layout, recurrent, scan
from hicache.reference.engine.config import ForwardConfig, ModelConfig
from hicache.reference.engine.model import (
    Params,
    chunk_rows,
    compiled_forward,
    init_params,
    step_input,
)

# Token ids or page ids: a list or an int array (serving code passes numpy arrays, the greedy loop lists).
TokenIds = Sequence[int] | np.ndarray


@dataclass(frozen=True)
class Generation:
    """Greedy output: ``tokens[i] == argmax(logits[i])``."""

    tokens: tuple[int, ...]
    logits: np.ndarray  # f32[len(tokens), vocab]


class PendingLogits:
    """Logits of forwards already dispatched (JAX async dispatch): ``result()`` waits for them and
    returns ``f32[n, vocab]``; ``last()`` only the last row's, from the last forward. Lets a caller
    overlap other work (a cache query) with a prefill."""

    def __init__(self, parts: list[tuple[jax.Array, int, int, int]]) -> None:
        # (logits f32[C, vocab] of one forward or f32[B, C, vocab] of a scan, chunk index in it, first row, end row)
        self._parts = parts

    @staticmethod
    def _rows(logits: jax.Array, chunk: int) -> np.ndarray:
        host = np.asarray(logits)
        return host[chunk] if host.ndim == 3 else host

    def result(self) -> np.ndarray:
        return np.concatenate([self._rows(logits, i)[lo:hi] for logits, i, lo, hi in self._parts])

    def last(self) -> np.ndarray:
        logits, i, _, hi = self._parts[-1]
        return self._rows(logits, i)[hi - 1]


def greedy_decode(step: Callable[[list[int]], np.ndarray], tokens: TokenIds, last_logits: np.ndarray,
                  max_new_tokens: int, stop_token: int | None = None,
                  between_steps: Callable[[], None] | None = None) -> Generation:
    """The greedy loop: ``step(seq)`` computes the last position of ``seq`` and returns its logits
    ``f32[vocab]``. ``between_steps()``, if given, runs before each step (after each token but the
    last): a serving loop takes in arrivals there, as SGLang's event loop does between decode steps.
    The first token is out (its ``between_steps()`` called) before the decode's own setup: ``seq`` is
    built after it (and ``ModelRunner.decoder`` checks its request at its first step)."""
    out_tokens: list[int] = []
    out_logits = [np.asarray(last_logits, np.float32)]
    seq: list[int] | None = None
    while True:
        nxt = int(np.argmax(out_logits[-1]))
        out_tokens.append(nxt)
        if len(out_tokens) == max_new_tokens or nxt == stop_token:
            break
        if between_steps is not None:
            between_steps()
        if seq is None:
            seq = np.asarray(tokens, np.int64).tolist() + out_tokens
        else:
            seq.append(nxt)
        out_logits.append(step(seq))
    return Generation(tuple(out_tokens), np.stack(out_logits))


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold positions ``[0, num_tokens)``."""
    return -(-num_tokens // page_size)


def tracked_len(prompt_len: int, seq_len: int, page_size: int) -> int:
    """The tokens whose state a decode with a ``track_slot`` (``ModelRunner.decode_step``) left there, once
    its steps computed positions ``[prompt_len, seq_len)``: the last page end ``p`` with
    ``prompt_len <= p < seq_len``, or 0 when it crossed none (the slot holds no state of this request)."""
    last = (seq_len - 1) // page_size * page_size
    return last if seq_len > prompt_len and last >= prompt_len else 0


def prefill_start(hit_len: int, num_tokens: int, page_size: int) -> int:
    """Where prefill starts given a cached prefix of ``hit_len`` tokens: page-aligned and leaving at
    least the last prompt token to compute (its logits start decoding)."""
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    usable = min(max(hit_len, 0), num_tokens - 1)
    return usable - usable % page_size


# A request's inputs for the extra pools: (state slot, padded SWA table), or None without extra pools.
_Extra = tuple[int | None, np.ndarray | None] | None

# ``ModelRunner(scan_chunks=None)`` takes this, read at construction (one place for every runner of a
# process, the benchmarks' bare engine included). 1: a dispatch per chunk. Scans cut long prefills but
# not short ones (docs/performance.md), so they shrink the no-cache baselines more than the cached
# configs' prefills, and the cache's benchmark ratios (TTFT speedup, no-reuse overhead) with them: off
# by default; 32 (the batched decode's largest program) to serve long prompts faster.
SCAN_CHUNKS_DEFAULT = 1
TABLE_MEMO = 256  # page tables a runner remembers as checked (``_check_table``)


class ModelRunner:
    """Runs the reference model over an L1 pool. One thread at a time (it owns the pool)."""

    def __init__(
        self,
        model: ModelConfig,
        fwd: ForwardConfig = ForwardConfig(),
        num_pages: int = 256,
        *,
        device: jax.Device | None = None,
        params: Params | None = None,
        pool: jax.Array | None = None,
        scan_chunks: int | None = None,
        state_slots: int = 0,
        swa_pages: int = 0,
    ) -> None:
        """Without ``pool``, a zeroed pool of ``num_pages`` pages is made on ``device`` (default: the
        first device). With ``pool`` (e.g. the HostWorker's L1 array, possibly sharded on the KV-head
        axis over a mesh), ``num_pages`` and ``device`` are ignored: params and per-step inputs are
        replicated over the pool's devices (``kv_layout.replicated_like``). ``scan_chunks`` (a power of
        two, default ``SCAN_CHUNKS_DEFAULT``): the most consecutive chunks of one request dispatched as
        one scan (``_run``); 1, or a pool off one device of a platform in ``scan.BIT_EXACT_PLATFORMS``:
        one dispatch per chunk. ``state_slots``: the recurrent state pool's slots (models with
        ``recurrent_layers`` only, which need > 0; the head's ``MambaConfig.num_slots``); their forwards
        take each request's slot (``state_slot=``) and run one dispatch per chunk. ``swa_pages`` > 0 (models
        with sliding-window layers): those layers keep their K/V in a pool of their own of that many pages
        (the head's SWA pool, ``SWAConfig.num_tokens // page_size``), addressed by each request's SWA page
        table (``swa_table=``, ``SWAComponent.translate`` of its page table); their slots of the L1 pool
        stay unused."""
        if not isinstance(swa_pages, int) or isinstance(swa_pages, bool) or swa_pages < 0:
            raise ValueError(f"swa_pages must be an int >= 0, got {swa_pages!r}")
        if swa_pages and not model.swa_layers:
            raise ValueError(f"swa_pages={swa_pages} given for a model without sliding-window layers")
        if not isinstance(state_slots, int) or isinstance(state_slots, bool) or state_slots < 0:
            raise ValueError(f"state_slots must be an int >= 0, got {state_slots!r}")
        if bool(model.recurrent_layers) != (state_slots > 0):
            raise ValueError(f"state_slots={state_slots}: a model with recurrent layers "
                             f"{model.recurrent_layers} needs state slots, one without needs none")
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        if scan_chunks is None:
            scan_chunks = SCAN_CHUNKS_DEFAULT
        if (not isinstance(scan_chunks, int) or isinstance(scan_chunks, bool) or scan_chunks <= 0
                or scan_chunks & (scan_chunks - 1)):
            raise ValueError(f"scan_chunks must be a positive power of two, got {scan_chunks!r}")
        self.model = model
        self.fwd = fwd
        if pool is None:
            dev = device if device is not None else jax.devices()[0]
            pool = kv_layout.make_pool(model, num_pages, fwd.page_size, dev)
        self.placement = kv_layout.replicated_like(pool)  # where params and step inputs live
        # A forward's step input (one i32 array of a few hundred bytes, ``step_input``) goes to the
        # jitted forward as a numpy array in one process: jit places it itself, replicated like
        # ``placement``, on its C++ path (faster than a ``jax.device_put`` per input:
        # docs/performance.md). Several processes (a multi-host replica) keep the explicit global
        # placement.
        self._put_inputs: Callable = ((lambda x: x) if jax.process_count() == 1
                                      else (lambda x: jax.device_put(x, self.placement)))
        self.params = params if params is not None else init_params(model, self.placement)
        self._forward = compiled_forward(model, fwd.chunk_size, swa_pages > 0)
        self._scan_fn = scan.compiled_scan(model, fwd.chunk_size)
        self._scan_request = scan_chunks
        self.scan_supported = False  # set by set_pool, with the pool's platform
        self.scan_chunks = 1  # set by set_pool: ``scan_chunks`` where the scan is bit-identical, else 1
        self._tables: dict[bytes, np.ndarray] = {}  # checked page tables (``_check_table``), by content
        self._pool_signature: tuple | None = None
        self._swa_pages = swa_pages
        self.set_pool(pool)
        self._state: jax.Array | None = (recurrent.make_state_pool(model, state_slots, self.placement)
                                         if state_slots else None)
        self._swa: jax.Array | None = self._make_swa_pool(swa_pages) if swa_pages else None
        self.forwards = 0  # fixed-shape forwards run so far (prefill chunks + decode steps)

    @property
    def page_size(self) -> int:
        return self.fwd.page_size

    # --- pools ---------------------------------------------------------------------------------

    @property
    def pool(self) -> jax.Array:
        """The L1 pool ``[L, 2, P, S, Hkv, D]``; valid until the next forward (which donates it)."""
        return self._kv

    def set_pool(self, kv_pool: jax.Array) -> None:
        """Hand a (possibly updated) pool back to the runner, e.g. after a host->device load. A pool of
        the shape, dtype and sharding already checked is taken without checking again (a worker lends
        the runner its L1 array for every model call)."""
        signature = (kv_pool.shape, kv_pool.dtype, kv_pool.sharding)
        if signature == self._pool_signature:
            self._kv = kv_pool
            return
        geo = kv_layout.check_pool(self.model, kv_pool)
        if kv_pool.sharding.device_set != self.placement.device_set:
            raise ValueError(f"pool sharding {kv_pool.sharding} is not on the runner's devices "
                             f"({self.placement})")
        if geo.page_size != self.fwd.page_size:
            raise ValueError(
                f"pool page_size={geo.page_size} != ForwardConfig.page_size={self.fwd.page_size}")
        self._kv = kv_pool
        self.num_pages = geo.num_pages
        self._tables.clear()  # checked against the old pool's page count
        devices = kv_pool.sharding.device_set
        # whether the scanned chunk program is bit-identical here (``hicache.reference.engine.scan``)
        # (jax's Device stub lacks ``platform``, a runtime attribute of every device)
        self.scan_supported = all(scan.supported(d.platform) for d in devices)  # type: ignore[attr-defined]
        one_device = len(devices) == 1 and jax.process_count() == 1
        extra_pools = bool(self.model.recurrent_layers) or self._swa_pages > 0  # (the scan carries no extra pool)
        self.scan_chunks = self._scan_request if one_device and self.scan_supported and not extra_pools else 1
        self._pool_signature = signature

    def _make_swa_pool(self, num_pages: int, sharding: jax.sharding.Sharding | None = None) -> jax.Array:
        shape = (len(self.model.swa_layers), 2, num_pages, self.fwd.page_size, self.model.num_kv_heads,
                 self.model.head_dim)
        return jnp.zeros(shape, self.model.jnp_dtype, device=self.placement if sharding is None else sharding)

    @property
    def swa_pool(self) -> jax.Array | None:
        """The sliding-window layers' pool ``[L_swa, 2, P_swa, S, Hkv, D]`` (None: they use the L1 pool)."""
        return self._swa

    def component_pool(self, name: str) -> jax.Array:
        """The extra pool a worker owns and lends (``HostWorker`` component pools): ``"swa"``, the
        sliding-window layers' pool, ``"mamba"``, the recurrent state pool; valid until the next forward,
        like ``pool``."""
        pool = {"swa": self._swa, "mamba": self._state}.get(name)
        if pool is None:
            kept = [n for n, p in (("swa", self._swa), ("mamba", self._state)) if p is not None]
            raise ValueError(f"this runner has no component pool {name!r} (it keeps: {kept or 'none'})")
        return pool

    def set_component_pool(self, name: str, array: jax.Array) -> None:
        """Hands a component pool back (after a transfer replaced it); shape and dtype must match."""
        current = self.component_pool(name)
        if array.shape != current.shape or array.dtype != current.dtype:
            raise ValueError(f"component pool {name!r}: got {array.shape} {array.dtype}, want "
                             f"{current.shape} {current.dtype}")
        if name == "swa":
            self._swa = array
        else:
            self._state = array

    @property
    def state_pool(self) -> jax.Array | None:
        """The recurrent state pool ``f32[R, 2, slots, 1, H, D/2H]`` (``recurrent``'s layout; None without
        recurrent layers); like ``pool``,
        valid until the next forward."""
        return self._state

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """``state[dst] := state[src]`` for each ``(src, dst)``: a request's working slot takes the cached
        state it continues from (``MambaRequest.copies``), before its next forward."""
        self._state = recurrent.copy_states(self._require_states(), copies)

    def zero_states(self, slots: Sequence[int]) -> None:
        """Zeroes ``slots``: a request that continues from no cached state starts there."""
        self._state = recurrent.zero_states(self._require_states(), slots)

    def _require_states(self) -> jax.Array:
        if self._state is None:
            raise ValueError(f"the model has no recurrent layers (recurrent_layers={self.model.recurrent_layers})")
        return self._state

    # --- forwards ------------------------------------------------------------------------------

    def extend(self, tokens: TokenIds, page_table: TokenIds, start_pos: int,
               state_slot: int | None = None, swa_table: TokenIds | None = None) -> np.ndarray:
        """Compute positions ``[start_pos, len(tokens))`` of a sequence whose positions
        ``< start_pos`` are already in its pages; writes their K/V. ``tokens`` is the whole sequence.
        With recurrent layers, ``state_slot`` holds the state after ``start_pos`` tokens and then the
        state after all of them (every call below takes it the same way). With an SWA pool, ``swa_table``
        is the request's SWA page table (one entry per page of ``page_table``, -1 for a dropped page).

        Returns logits ``f32[len(tokens) - start_pos, vocab]``.
        """
        return self.start_extend(tokens, page_table, start_pos, state_slot, swa_table).result()

    def start_extend(self, tokens: TokenIds, page_table: TokenIds, start_pos: int,
                     state_slot: int | None = None, swa_table: TokenIds | None = None,
                     track_slot: int | None = None) -> PendingLogits:
        """``extend`` without waiting: dispatches the forwards (the pool is rebound to their output at
        once, so later transfers and forwards are ordered after them) and returns their logits to come.
        ``track_slot``: as ``decode_step``'s (everything is checked before the copy)."""
        toks, table = self._check(tokens, page_table, start_pos)
        extra = (self._check_slot(state_slot), self._check_swa_table(swa_table, int(toks.size)))
        self._track(start_pos, extra[0], self._check_track(track_slot, extra[0]))
        return self._run(toks, table, start_pos, extra)

    def prefill(self, tokens: TokenIds, page_table: TokenIds, start_pos: int = 0,
                state_slot: int | None = None, swa_table: TokenIds | None = None) -> np.ndarray:
        """Prefill a prompt after a cached prefix of ``start_pos`` tokens (a multiple of the page size,
        its K/V already in the first pages of ``page_table``). Returns the last logits ``f32[vocab]``."""
        if not isinstance(start_pos, (int, np.integer)) or start_pos % self.fwd.page_size:
            raise ValueError(
                f"start_pos={start_pos!r} must be a multiple of page_size={self.fwd.page_size}")
        return self.start_extend(tokens, page_table, int(start_pos), state_slot, swa_table).last()

    def decode_step(self, tokens: TokenIds, page_table: TokenIds, state_slot: int | None = None,
                    swa_table: TokenIds | None = None, track_slot: int | None = None) -> np.ndarray:
        """One decode step: computes the last position of ``tokens`` (all earlier ones are in the
        pages) and returns its logits ``f32[vocab]``. ``track_slot`` (recurrent layers): before the forward,
        when the working state is at a page end (``len(tokens) - 1`` tokens, a page multiple), that slot takes
        a copy of it, on device (SGLang's Mamba extra buffer: the state a finished request caches there)."""
        return self.start_extend(tokens, page_table, len(tokens) - 1, state_slot, swa_table, track_slot).last()

    def decode_step_input(self, tokens: TokenIds, page_table: TokenIds) -> tuple[np.ndarray, int, int]:
        """What ``decode_step`` forwards, checked as it checks it: (the step input
        ``i32[3 + C + max_pages]`` of the chunk holding the last position, that position's row in the
        chunk, the page it writes). For callers that batch several requests' steps (``engine.batched``)."""
        if self.model.recurrent_layers or self._swa is not None:
            raise ValueError("batched decode steps of a model with recurrent layers or an SWA pool are not supported")
        toks, table = self._check(tokens, page_table, len(tokens) - 1)
        p, c = int(toks.size) - 1, self.fwd.chunk_size
        return step_input(toks[p:], table, p - p % c, p, p + 1, c), p % c, int(table[p // self.fwd.page_size])

    def put_inputs(self, steps: np.ndarray) -> np.ndarray | jax.Array:
        """Step inputs (``i32[..., 3 + C + max_pages]``) as this runner's forwards take them: as they are
        in one process, one global array across hosts."""
        return self._put_inputs(steps)

    def decode(self, tokens: TokenIds, last_logits: np.ndarray, page_table: TokenIds,
               max_new_tokens: int, stop_token: int | None = None,
               between_steps: Callable[[], None] | None = None, state_slot: int | None = None,
               swa_table: TokenIds | None = None, track_slot: int | None = None) -> Generation:
        """Greedy decoding after a prefill of ``tokens`` whose last logits are ``last_logits``.

        Generates up to ``max_new_tokens`` (stops after ``stop_token``). Writes K/V for every
        generated token except the last, so ``page_table`` must cover
        ``len(tokens) + max_new_tokens - 1`` positions. ``between_steps()`` runs before each decode
        step (see ``greedy_decode``). ``track_slot``: as ``decode_step``'s, at every step (``tracked_len``
        says which state it holds at the end).
        """
        return greedy_decode(self.decoder(tokens, page_table, max_new_tokens, state_slot, swa_table, track_slot),
                             tokens, last_logits, max_new_tokens, stop_token, between_steps)

    def decoder(self, tokens: TokenIds, page_table: TokenIds, max_new_tokens: int, state_slot: int | None = None,
                swa_table: TokenIds | None = None, track_slot: int | None = None) -> Callable[[TokenIds], np.ndarray]:
        """One request's decode steps, checked once: ``max_new_tokens`` and the table's length now, the
        prompt ``tokens`` and the pages of its final length ``len(tokens) + max_new_tokens - 1`` at the
        first step, before its forward (``ValueError``; after the first token is out, as
        ``greedy_decode`` hands it out before the decode's setup). Returns ``step(seq)``: ``seq`` is
        ``tokens`` plus the tokens generated so far; it forwards the last position of ``seq`` (earlier
        ones in the pages) and returns its logits ``f32[vocab]``, as ``decode_step(seq, page_table)``
        would, checking only that one position (inside the checked length) and its token (inside the
        vocabulary). The steps of ``decode``; a caller that lends the pool out between steps
        (``WorkerEngine``) calls ``step`` with the pool lent back."""
        self._check_decode(tokens, page_table, max_new_tokens)
        extra = (self._check_slot(state_slot), self._check_swa_table(swa_table, len(tokens) + max_new_tokens - 1))
        track = self._check_track(track_slot, extra[0])
        c, vocab = self.fwd.chunk_size, self.model.vocab_size
        first = end = 0  # positions [first, end) have checked pages; set by the first step
        table: np.ndarray | None = None

        def step(seq: TokenIds) -> np.ndarray:
            nonlocal first, end, table
            if table is None:
                first = int(self._check_tokens(tokens).size)  # the first position a step computes
                end = first + max_new_tokens - 1
                table = self._check_table(page_table, end)
            pos = len(seq) - 1
            if not first <= pos < end:
                raise ValueError(f"decode step at position {pos}: the request was checked for positions "
                                 f"[{first}, {end})")
            token = int(seq[-1])
            if not 0 <= token < vocab:
                raise ValueError(f"token id {token} at index {pos} is outside the vocabulary [0, {vocab})")
            self._track(pos, extra[0], track)
            return PendingLogits([self._dispatch(np.array([token], np.int32), table, pos - pos % c, pos,
                                                 pos + 1, extra)]).last()

        return step

    def generate(self, tokens: TokenIds, page_table: TokenIds, max_new_tokens: int,
                 start_pos: int = 0, stop_token: int | None = None, state_slot: int | None = None,
                 swa_table: TokenIds | None = None) -> Generation:
        """``prefill`` from ``start_pos`` then greedy ``decode``, in the runner's pool."""
        self._check_decode(tokens, page_table, max_new_tokens)
        logits = self.prefill(tokens, page_table, start_pos, state_slot, swa_table)
        return self.decode(tokens, logits, page_table, max_new_tokens, stop_token, state_slot=state_slot,
                           swa_table=swa_table)

    def generate_no_cache(self, tokens: TokenIds, max_new_tokens: int,
                          stop_token: int | None = None) -> Generation:
        """Reference path: the same greedy generation in a fresh zeroed pool (same shape as L1, so
        the same compiled forward), nothing reused and the runner's L1 pool untouched. Allocates
        a pool the size of L1 for the call (and a zeroed state pool, with recurrent layers)."""
        saved, saved_states, saved_swa = self._kv, self._state, self._swa
        num_tokens = len(tokens) + max(max_new_tokens, 1) - 1
        table = list(range(min(pages_needed(max(num_tokens, 1), self.fwd.page_size), self.num_pages)))
        self._kv = kv_layout.make_pool(self.model, self.num_pages, self.fwd.page_size,
                                       saved.sharding)
        slot = None
        if saved_states is not None:
            self._state = recurrent.make_state_pool(self.model, recurrent.num_slots(saved_states),
                                                    saved_states.sharding)  # (a worker's: sharded)
            slot = 0
        swa_table = None
        if saved_swa is not None:  # the same pool shape (the same program): SWA page i for page i
            if len(table) > saved_swa.shape[2]:
                raise ValueError(f"{len(table)} pages exceed the SWA pool ({saved_swa.shape[2]} pages)")
            self._swa = self._make_swa_pool(saved_swa.shape[2], saved_swa.sharding)  # (a worker's: sharded)
            swa_table = table
        try:
            return self.generate(tokens, table, max_new_tokens, 0, stop_token, slot, swa_table)
        finally:
            self._kv, self._state, self._swa = saved, saved_states, saved_swa

    # --- internals -----------------------------------------------------------------------------

    def _check_decode(self, tokens: TokenIds, page_table: TokenIds,
                      max_new_tokens: int) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        need = pages_needed(len(tokens) + max_new_tokens - 1, self.fwd.page_size)
        if len(page_table) < need:
            raise ValueError(f"page_table has {len(page_table)} pages, {need} needed for "
                             f"{len(tokens)} tokens + {max_new_tokens} new tokens")

    def _check(self, tokens: TokenIds, page_table: TokenIds,
               start_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """Validate one request; returns ``tokens i32[n]`` and the padded ``page_table i32[max_pages]``."""
        toks = self._check_tokens(tokens)
        n = int(toks.size)
        if not isinstance(start_pos, (int, np.integer)) or not 0 <= start_pos < n:
            raise ValueError(f"start_pos={start_pos!r} must be in [0, {n}) for {n} tokens")
        return toks, self._check_table(page_table, n)

    def _check_slot(self, state_slot: int | None) -> int | None:
        """The request's state slot: required with recurrent layers (inside the pool), else None."""
        if self._state is None:
            if state_slot is not None:
                raise ValueError(f"state_slot={state_slot!r} given, but the model has no recurrent layers")
            return None
        if not isinstance(state_slot, (int, np.integer)) or isinstance(state_slot, bool):
            raise ValueError(f"a model with recurrent layers needs an int state_slot, got {state_slot!r}")
        n = recurrent.num_slots(self._state)
        if not 0 <= state_slot < n:
            raise ValueError(f"state_slot {state_slot} is outside the state pool [0, {n})")
        return int(state_slot)

    def _check_track(self, track_slot: int | None, state_slot: int | None) -> int | None:
        """The request's track slot (``decode_step``), if any: inside the state pool, not its working slot."""
        if track_slot is None:
            return None
        if state_slot is None:
            raise ValueError(f"track_slot={track_slot!r} given without a state_slot (a model with recurrent layers)")
        if not isinstance(track_slot, (int, np.integer)) or isinstance(track_slot, bool):
            raise ValueError(f"track_slot must be an int slot id, got {track_slot!r}")
        n = recurrent.num_slots(self._require_states())
        if not 0 <= track_slot < n or track_slot == state_slot:
            raise ValueError(f"track_slot {track_slot} must be a slot of the state pool [0, {n}) other than the "
                             f"working state_slot {state_slot}")
        return int(track_slot)

    def _track(self, pos: int, slot: int | None, track: int | None) -> None:
        """Before the forward at ``pos``: the working state is the state after ``pos`` tokens; at a page end
        the track slot takes a copy (one small on-device op per page, queued before the forward)."""
        if track is not None and slot is not None and pos % self.fwd.page_size == 0:
            self._state = recurrent.copy_states(self._require_states(), ((slot, track),))

    def _check_swa_table(self, swa_table: TokenIds | None, n: int) -> np.ndarray | None:
        """The request's SWA page table padded to ``i32[max_pages]`` (-1 past its pages): required with an
        SWA pool (ids in [-1, P_swa): -1 where the tree dropped that page's SWA KV), else None."""
        if self._swa is None:
            if swa_table is not None:
                raise ValueError("swa_table given, but this runner keeps no SWA pool (swa_pages=0)")
            return None
        if swa_table is None:
            raise ValueError("a runner with an SWA pool needs each request's swa_table")
        arr = np.asarray(swa_table)
        need = pages_needed(n, self.fwd.page_size)
        if arr.ndim != 1 or arr.size < need or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"swa_table must be a 1-D int sequence of >= {need} pages, got {swa_table!r:.80}")
        used = arr[:need]
        bad = np.flatnonzero((used < -1) | (used >= self._swa.shape[2]))
        if bad.size:
            raise ValueError(f"swa page id {int(used[bad[0]])} at index {int(bad[0])} is outside "
                             f"[-1, {self._swa.shape[2]})")
        padded = np.full(self.fwd.max_pages, -1, np.int32)
        padded[:need] = used
        return padded

    def _check_tokens(self, tokens: TokenIds) -> np.ndarray:
        """``tokens`` as i32[n]: a non-empty 1-D sequence of ids inside the vocabulary (an i32 array is
        returned as it is, not copied: callers only read it)."""
        toks = np.asarray(tokens)
        if toks.ndim != 1 or toks.size == 0 or not np.issubdtype(toks.dtype, np.integer):
            raise ValueError(f"tokens must be a non-empty 1-D sequence of ints, got {tokens!r:.80}")
        if toks.min() < 0 or toks.max() >= self.model.vocab_size:
            bad = np.flatnonzero((toks < 0) | (toks >= self.model.vocab_size))
            raise ValueError(f"token id {int(toks[bad[0]])} at index {int(bad[0])} is outside the "
                             f"vocabulary [0, {self.model.vocab_size})")
        return toks.astype(np.int32, copy=False)

    def _check_table(self, page_table: TokenIds, n: int) -> np.ndarray:
        """The padded ``page_table i32[max_pages]`` of a request of ``n`` positions: its first pages
        (those ``n`` positions need) distinct and inside the pool. Read-only, and remembered by the
        contents of those first pages (up to ``TABLE_MEMO`` of them, forgotten when the pool's
        geometry changes): a request's decode steps check its table once per page it grows into."""
        ps, max_pages = self.fwd.page_size, self.fwd.max_pages
        if n > self.fwd.max_context:
            raise ValueError(f"{n} tokens exceed max_context={self.fwd.max_context} "
                             f"(max_pages={max_pages} x page_size={ps})")
        table = np.asarray(page_table)
        if table.ndim != 1 or (table.size and not np.issubdtype(table.dtype, np.integer)):
            raise ValueError(f"page_table must be a 1-D sequence of ints, got {page_table!r:.80}")
        need = pages_needed(n, ps)
        if table.size < need:
            raise ValueError(f"page_table has {table.size} pages, {need} needed for {n} tokens "
                             f"at page_size={ps}")
        used = table[:need]
        key = used.astype(np.int64, copy=False).tobytes()
        padded = self._tables.get(key)
        if padded is not None:
            return padded
        if used.min() < 0 or used.max() >= self.num_pages:
            bad = np.flatnonzero((used < 0) | (used >= self.num_pages))
            raise ValueError(f"page id {int(used[bad[0]])} at index {int(bad[0])} is outside the "
                             f"pool [0, {self.num_pages})")
        seen = np.zeros(self.num_pages, np.bool_)
        seen[used] = True
        if np.count_nonzero(seen) != need:
            raise ValueError(f"page_table repeats a page among its first {need}: {used.tolist()}")
        padded = np.zeros(max_pages, np.int32)
        padded[:need] = used
        padded.flags.writeable = False
        if len(self._tables) >= TABLE_MEMO:
            del self._tables[next(iter(self._tables))]  # the oldest
        self._tables[key] = padded
        return padded

    def _forward_steps(self, steps: list[np.ndarray]) -> jax.Array:
        """Forward step inputs (each ``i32[3 + C + max_pages]``, ``step_input``; built from checked
        requests: nothing is checked here) in order, in one dispatch, and rebind the pool to the output
        (the old one is donated): one step runs the chunk program itself, several its scan (only where
        ``scan.supported``: the caller's to decide). Returns logits ``f32[C, vocab]`` (one step) or
        ``f32[B, C, vocab]`` to come. Counts nothing (``forwards`` is the caller's)."""
        if self._state is not None or self._swa is not None:  # (one step: ``scan_chunks`` is 1 then)
            assert len(steps) == 1, "a runner with extra pools runs one chunk per dispatch"
            pools = [p for p in (self._swa, self._state) if p is not None]
            logits, self._kv, *pools = self._forward(self.params, self._kv, *pools, self._put_inputs(steps[0]))
            if self._swa is not None:
                self._swa = pools[0]
            if self._state is not None:
                self._state = pools[-1]
        elif len(steps) == 1:
            logits, self._kv = self._forward(self.params, self._kv, self._put_inputs(steps[0]))
        else:
            logits, self._kv = self._scan_fn(self.params, self._kv, self._put_inputs(np.stack(steps)))
        return logits

    def _dispatch(self, chunk_tokens: np.ndarray, table: np.ndarray, base: int, lo: int,
                  hi: int, extra: _Extra = None) -> tuple[jax.Array, int, int, int]:
        """Dispatch one forward (positions ``[lo, hi)`` of the chunk at ``base``; ``extra``: the request's
        state slot and SWA table, where the runner has those pools). Returns (logits f32[C, vocab] to come, 0,
        first row, end row)."""
        slot, swa = (None, None) if extra is None else extra
        logits = self._forward_steps([step_input(chunk_tokens, table, base, lo, hi, self.fwd.chunk_size, slot, swa)])
        self.forwards += 1
        return logits, 0, lo - base, hi - base

    def _run(self, toks: np.ndarray, table: np.ndarray, start: int, extra: _Extra = None) -> PendingLogits:
        """Dispatch the aligned chunks of positions ``[start, len(toks))``. Returns logits
        f32[len(toks) - start, vocab] to come. Where the scanned chunk program is bit-identical
        (``scan_chunks`` > 1), consecutive chunks go in scans of power-of-two lengths up to
        ``scan_chunks`` (``scan.groups``: largest first; a single chunk left goes alone): one dispatch
        for 2, 4, 8, ... chunks instead of one each."""
        c = self.fwd.chunk_size
        rows = chunk_rows(start, int(toks.size), c)
        if len(rows) == 1 or self.scan_chunks == 1:
            return PendingLogits([self._dispatch(toks[lo:hi], table, base, lo, hi, extra) for base, lo, hi in rows])
        parts: list[tuple[jax.Array, int, int, int]] = []
        i = 0
        for size in scan.groups(len(rows), self.scan_chunks):
            group = rows[i:i + size]
            logits = self._forward_steps([step_input(toks[lo:hi], table, base, lo, hi, c) for base, lo, hi in group])
            parts += [(logits, j, lo - base, hi - base) for j, (base, lo, hi) in enumerate(group)]
            i += size
        self.forwards += len(rows)
        return PendingLogits(parts)
