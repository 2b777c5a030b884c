"""Expected time to first token of a prompt on one replica, from what its head holds and its load.

Pure arithmetic, run by the router (in the serving front end, once per request and candidate). A prefix
in L1 is reused in place, one in L2 is loaded back, one in L3 is fetched then loaded (L3 is shared: the
longest stored prefix any replica reports counts on every replica), the rest is computed. The queue
ahead of the prompt costs ``service_s`` per request queued or running there.
"""

from __future__ import annotations

from dataclasses import dataclass

from hicache.cluster.route_query import TierHits


@dataclass(frozen=True)
class TTFTModel:
    """Seconds per token of each way a prompt's prefix is served, per request, and the initial mean
    service time of a request (the router's estimate of one queue slot; it learns it from completions)."""

    compute_s_per_token: float = 1e-4
    l2_s_per_token: float = 1e-5
    l3_s_per_token: float = 3e-5
    request_s: float = 1e-3
    service_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("compute_s_per_token", "l2_s_per_token", "l3_s_per_token", "request_s", "service_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ValueError(f"TTFTModel.{name} must be a number >= 0, got {v!r}")


@dataclass(frozen=True)
class Estimate:
    """One candidate's expected TTFT (``wait_s`` + ``service_s``) and how its prompt would be served."""

    ttft_s: float
    wait_s: float
    service_s: float
    l1: int
    l2: int
    l3: int
    computed: int


def split_prompt(prompt_len: int, hits: TierHits | None, l3_shared: int) -> tuple[int, int, int, int]:
    """(L1, L2, L3, computed) tokens of a prompt on a replica whose head reported ``hits`` (None: it did
    not answer, so only the shared L3 counts), with ``l3_shared`` the longest stored prefix known."""
    l1 = l2 = 0
    if hits is not None:
        l1 = min(hits.l1, prompt_len)
        l2 = min(hits.l2, prompt_len - l1)
    l3 = max(0, min(l3_shared, prompt_len) - l1 - l2)
    return l1, l2, l3, prompt_len - l1 - l2 - l3


def estimate(model: TTFTModel, prompt_len: int, hits: TierHits | None, l3_shared: int, outstanding: float,
             service_s: float) -> Estimate:
    """The expected TTFT of a ``prompt_len``-token prompt on one replica with ``outstanding`` requests
    queued or running, each worth ``service_s``."""
    l1, l2, l3, computed = split_prompt(prompt_len, hits, l3_shared)
    own = (model.request_s + computed * model.compute_s_per_token + l2 * model.l2_s_per_token
           + l3 * (model.l3_s_per_token + model.l2_s_per_token))
    wait = max(0.0, outstanding) * service_s
    return Estimate(wait + own, wait, own, l1, l2, l3, computed)
