"""The per-request token accounting check every serving test runs on its results (issue #27)."""

from __future__ import annotations

from collections.abc import Iterable

from hicache.cluster.token_account import TokenAccount
from hicache.reference.serve_types import ServeResult


def assert_tokens_accounted(results: ServeResult | Iterable[ServeResult]) -> list[TokenAccount]:
    """Each result's ``tokens`` counts every prompt token exactly once and agrees with the result's own
    hit and compute counts; returns the records (for tests that check their reasons)."""
    if isinstance(results, ServeResult):
        results = [results]
    accounts = []
    for res in results:
        t = res.tokens
        assert isinstance(t, TokenAccount), f"no token account in {res!r:.120}"
        assert t.prompt_len == res.prompt_len
        assert t.hit_l1 + t.hit_l2 + t.hit_l3 + t.missed_tokens == res.prompt_len
        assert t.hit_l1 == res.device_hit_tokens
        assert t.hit_l2 + t.hit_l3 == res.loaded_tokens and t.hit_l3 == res.storage_tokens
        assert t.missed_tokens == res.computed_tokens
        accounts.append(t)
    return accounts
