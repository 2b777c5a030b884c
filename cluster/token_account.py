"""Where every prompt token of a request came from: hit in L1 / L2 / L3, or missed for one reason.

A ``TokenAccount`` is one request's record (frozen; it travels in the request's result and, once, to
its head): each of the prompt's tokens counted exactly once, as an L1, L2 or L3 hit or under one
``MissReason`` (``hicache.cluster.events``). Its constructor refuses a record whose parts do not sum
to the prompt length, so every served request checks the accounting.

Who decides what: the head explains the whole pages its match lacked (``explain_l3``: the tree's
reason, from the ghosts of evicted nodes and the other namespaces, replaced by what L3 said when it was
asked: unavailable, skipped by the cost model, unreadable, evicted from L3); the serving code, which
alone knows what it finally loaded, builds the record with ``account_request`` and reports it to the
head (``CacheHead.report_tokens``), which sums the records per replica (``cache_stats()['prompt_tokens']``,
the ``hicache_prompt_tokens`` metric, ``hicache status``). Pure values and functions: no locks, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hicache.cluster.events import MissReason
from hicache.cluster.storage_tier import (
    COST_SKIPPED,
    FINGERPRINT_DIFFERS,
    L3_UNAVAILABLE,
    PrefetchProgress,
    PrefetchState,
)

HIT_L1, HIT_L2, HIT_L3 = "hit_l1", "hit_l2", "hit_l3"  # the hit fates' names beside the MissReason values
FATES = (HIT_L1, HIT_L2, HIT_L3, *(r.value for r in MissReason))  # every name a record's ``as_dict`` may hold
_NOT_CACHED, _LOAD_FAILED, _PARTIAL = MissReason.NOT_CACHED, MissReason.LOAD_FAILED, MissReason.PARTIAL_PAGE


@dataclass(frozen=True, slots=True)
class TokenAccount:
    """One request's prompt tokens: ``hit_l1 + hit_l2 + hit_l3 + sum(missed) == prompt_len``. ``missed``:
    (reason, tokens) pairs, each reason once, tokens > 0."""

    prompt_len: int
    hit_l1: int = 0
    hit_l2: int = 0
    hit_l3: int = 0
    missed: tuple[tuple[MissReason, int], ...] = ()

    def __post_init__(self) -> None:
        # one request per call of a serving loop: the checks stay few and flat
        counts = (self.prompt_len, self.hit_l1, self.hit_l2, self.hit_l3)
        if not all(type(v) is int for v in counts) or min(counts) < 0:
            raise ValueError(f"TokenAccount counts must be ints >= 0, got {self!r}")
        missed = self.missed
        total = self.hit_l1 + self.hit_l2 + self.hit_l3
        for r, n in missed:
            if type(r) is not MissReason or type(n) is not int or n <= 0:
                raise ValueError(f"TokenAccount.missed must pair MissReasons with ints > 0, got {missed!r}")
            total += n
        if len(missed) > 1 and len({r for r, _ in missed}) != len(missed):
            raise ValueError(f"TokenAccount.missed names a reason twice: {missed!r}")
        if total != self.prompt_len:
            raise ValueError(f"TokenAccount accounts for {total} tokens, the prompt has {self.prompt_len}: {self!r}")

    @property
    def hit_tokens(self) -> int:
        return self.hit_l1 + self.hit_l2 + self.hit_l3

    @property
    def missed_tokens(self) -> int:
        return sum(n for _, n in self.missed)

    def miss(self, reason: MissReason) -> int:
        """Tokens missed for ``reason`` (0 if none)."""
        return next((n for r, n in self.missed if r is reason), 0)

    def as_dict(self) -> dict[str, int]:
        """Nonzero fates by name (``FATES``): what metrics and logs carry."""
        out = {HIT_L1: self.hit_l1, HIT_L2: self.hit_l2, HIT_L3: self.hit_l3}
        out.update((r.value, n) for r, n in self.missed)
        return {k: v for k, v in out.items() if v}


def account_request(prompt_len: int, page_size: int, *, hit_l1: int, hit_l2: int = 0, hit_l3: int = 0,
                    refused: tuple[MissReason | None, int] = (None, 0),
                    rest: MissReason | None = None) -> TokenAccount:
    """The record of a request whose key is its prompt but the last token (the reference scheduler's and
    SGLang's): past the key's last whole page, ``PARTIAL_PAGE``; of the whole pages, the hits, then
    ``refused``: the L2 part matched but not loaded back, and why (below threshold, over quota, no room,
    load failed); the rest missed for ``rest`` (the head's ``explain_l3``; None: ``NOT_CACHED``)."""
    if type(page_size) is not int or page_size <= 0:
        raise ValueError(f"page_size must be an int > 0, got {page_size!r}")
    if type(prompt_len) is not int or prompt_len < 1:
        raise ValueError(f"prompt_len must be an int >= 1, got {prompt_len!r}")
    whole = (prompt_len - 1) // page_size * page_size
    reason, refused_tokens = refused
    left = whole - hit_l1 - hit_l2 - hit_l3 - refused_tokens
    if left < 0:
        raise ValueError(f"hits {hit_l1}+{hit_l2}+{hit_l3} and {refused_tokens} refused exceed the key's "
                         f"{whole} whole-page tokens (prompt {prompt_len}, page {page_size})")
    rest = rest or _NOT_CACHED
    missed: list[tuple[MissReason, int]] = []
    if refused_tokens:
        reason = reason or _LOAD_FAILED
        if reason is rest and left:  # one pair per reason
            refused_tokens, left = refused_tokens + left, 0
        missed.append((reason, refused_tokens))
    if left:
        missed.append((rest, left))
    missed.append((_PARTIAL, prompt_len - whole))  # (>= 1: the last token is never in the key)
    return TokenAccount(prompt_len, hit_l1, hit_l2, hit_l3, tuple(missed))


def explain_l3(tree_reason: MissReason | None, progress: PrefetchProgress | None) -> MissReason | None:
    """Why the whole pages past a match are missed, once L3 was asked (``progress``: its answer; None:
    not asked): L3's own reason when it has one, else the tree's (``tree_reason``; None: nothing missed).
    L3 found nothing of pages the tree remembers storing there: they were evicted from L3. Pages the tree
    never saw that L3 holds under a previous fingerprint only (``StorageParams.previous_fingerprints``):
    the fingerprint differs."""
    if progress is None or tree_reason is None:
        return tree_reason
    state, why = progress.state, progress.reason
    if why == L3_UNAVAILABLE or (state is PrefetchState.RUNNING and why):  # down, or the wait ran out
        return MissReason.L3_UNAVAILABLE
    if state is PrefetchState.FAILED:
        return MissReason.L3_UNREADABLE
    if why == COST_SKIPPED:
        return MissReason.COST_SKIPPED
    if why == FINGERPRINT_DIFFERS and tree_reason is _NOT_CACHED:
        return MissReason.FINGERPRINT_DIFFERS
    return tree_reason


def add_to(totals: dict[str, int], account: TokenAccount) -> None:
    """Adds ``account`` to per-fate ``totals`` (a replica's running sums, keyed as ``as_dict``)."""
    for fate, n in account.as_dict().items():
        totals[fate] = totals.get(fate, 0) + n


def miss_summary(totals: Mapping[str, int], top: int = 3) -> str:
    """The largest miss reasons of per-fate ``totals`` as shares of all prompt tokens (``hicache status``):
    ``"not_cached 40% partial_page 3%"``; ``"-"`` when nothing was served."""
    served = sum(totals.values())
    if not served:
        return "-"
    hits = {HIT_L1, HIT_L2, HIT_L3}
    misses = sorted(((n, f) for f, n in totals.items() if f not in hits and n), reverse=True)[:top]
    return " ".join(f"{f} {n / served:.0%}" for n, f in misses) or "0"
