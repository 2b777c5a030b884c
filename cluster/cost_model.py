"""Load or recompute: the head's online estimate of what an L3 hit costs against a prefill.

Owned by the ``StorageTier`` of one head (one per replica) and used on the head's one thread only. It
keeps exponentially weighted estimates, measured from what the head already sees:

- L3 -> L2 fetches (``PREFETCH_S2H`` acks, one per host and op): a weighted linear fit of the op's
  duration on its bytes gives the first-byte latency (intercept) and the bytes/s (inverse slope);
- L2 -> L1 loads (``LOAD_H2D`` acks): bytes/s;
- bytes per page on one host (both kinds' acks);
- the engine's prefill: a weighted linear fit of a request's prefill seconds on its computed tokens,
  reported by the serving side (``report_prefill``); the slope is what recomputing a token costs (the
  intercept, one forward's fixed cost, is paid whether a prefix is loaded or not).

Hosts work in parallel on their own shards, so every estimate is per host: an op's time is one host's.
``choose`` decides, when an existence query answered, how many of the pages found to fetch: all, a
leading part that is back before the request stops waiting for it, or none (recompute). With the
model off (``CostOptions.enabled``) every page found is fetched, as before.

A fetch still unacked is evidence too: its age is a lower bound on its time (``PendingFetch``). While
no fetch was measured yet, a fetch older than the model's estimate for it tells that L3 is slower than
the defaults say, so requests that start while a slow first fetch is in flight decide on that bound
instead of fetching (and waiting) too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostOptions:
    """Defaults hold before anything is measured. They lean towards loading (a slow-ish prefill, a
    fast-ish L3) so the first hits are fetched and measured; a GCS object read costs tens of ms before
    its first byte and a host reads it at a few hundred MB/s; TPU hosts load L2->L1 at tens of GB/s."""

    enabled: bool = True
    alpha: float = 0.2  # weight of the newest sample in every moving estimate
    l3_latency_s: float = 0.02  # first-byte latency of an L3 fetch op, per host
    l3_bytes_per_s: float = 400e6  # L3 -> L2 bytes/s, per host
    load_bytes_per_s: float = 10e9  # L2 -> L1 bytes/s, per host
    prefill_tokens_per_s: float = 2000.0  # recompute rate
    page_bytes: float = 64 * 1024  # one page's bytes on one host, until an ack tells
    margin: float = 1.0  # load only if margin * expected load time < expected recompute time
    explore_every: int = 16  # every Nth skip fetches anyway: L3 that got fast again is measured (0: never)
    # a request waits for its fetch at most this many times the recompute of its pages (once a prefill was
    # measured; 0: no bound but StorageParams'): a fetch slower than expected costs a bounded wait, then the
    # request recomputes while the fetch goes on (and is measured)
    wait_factor: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"enabled must be a bool, got {self.enabled!r}")
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")
        if not (math.isfinite(self.l3_latency_s) and self.l3_latency_s >= 0):
            raise ValueError(f"l3_latency_s must be a finite number >= 0, got {self.l3_latency_s!r}")
        if not (isinstance(self.wait_factor, (int, float)) and math.isfinite(self.wait_factor) and self.wait_factor >= 0):
            raise ValueError(f"wait_factor must be a finite number >= 0, got {self.wait_factor!r}")
        for name in ("l3_bytes_per_s", "load_bytes_per_s", "prefill_tokens_per_s", "page_bytes", "margin"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if isinstance(self.explore_every, bool) or not isinstance(self.explore_every, int) or self.explore_every < 0:
            raise ValueError(f"explore_every must be an int >= 0, got {self.explore_every!r}")


class _Ewma:
    """An exponentially weighted mean (None until the first sample)."""

    __slots__ = ("alpha", "value", "samples")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0

    def add(self, x: float) -> None:
        self.value = x if self.value is None else self.value + self.alpha * (x - self.value)
        self.samples += 1

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


class _EwmaLine:
    """Exponentially weighted least squares of y on x: intercept and slope. With too little spread in
    x for a slope (ops all of one size), the slope is the prior and the line goes through the mean."""

    __slots__ = ("mx", "my", "mxx", "mxy")

    def __init__(self, alpha: float) -> None:
        self.mx, self.my, self.mxx, self.mxy = _Ewma(alpha), _Ewma(alpha), _Ewma(alpha), _Ewma(alpha)

    @property
    def samples(self) -> int:
        return self.mx.samples

    def add(self, x: float, y: float) -> None:
        self.mx.add(x)
        self.my.add(y)
        self.mxx.add(x * x)
        self.mxy.add(x * y)

    def fit(self, prior_intercept: float, prior_slope: float) -> tuple[float, float]:
        if not self.samples:
            return prior_intercept, prior_slope
        mx, my = self.mx.get(0.0), self.my.get(0.0)
        var = self.mxx.get(0.0) - mx * mx
        slope = prior_slope
        if var > (0.1 * mx) ** 2:  # sizes differ by ~10%+: the data carry a slope
            fitted = (self.mxy.get(0.0) - mx * my) / var
            if fitted > 0:
                slope = fitted
        intercept = my - slope * mx
        if intercept < 0:  # all of the time is per byte
            intercept, slope = 0.0, (my / mx if mx > 0 else slope)
        return intercept, slope


@dataclass(frozen=True)
class PrefillReport:
    """What the serving side tells the head after a prefill (``CacheHead.report_prefill``): it computed
    ``tokens`` prompt tokens in ``seconds``."""

    tokens: int
    seconds: float

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ValueError(f"PrefillReport.tokens must be an int >= 0, got {self.tokens!r}")
        if not (isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"PrefillReport.seconds must be a finite number >= 0, got {self.seconds!r}")


@dataclass(frozen=True)
class PendingFetch:
    """The oldest L3 -> L2 fetch still unacked: ``pages`` pages sent ``age_s`` seconds ago."""

    pages: int
    age_s: float


@dataclass(frozen=True)
class FetchPlan:
    """``pages`` of the found ones to fetch (0: recompute them all) and the estimates behind it."""

    pages: int
    fetch_s: float  # expected L3 -> L2 time of those pages
    load_s: float  # expected L2 -> L1 time of those pages
    recompute_s: float  # expected prefill time of all the found pages
    explored: bool = False  # fetched although the model said recompute (``explore_every``)


class CostModel:
    def __init__(self, options: CostOptions | None = None) -> None:
        self.options = options = options or CostOptions()
        a = options.alpha
        self._fetch = _EwmaLine(a)  # x: bytes on one host, y: seconds
        self._load_rate = _Ewma(a)
        self._page_bytes = _Ewma(a)
        self._prefill = _EwmaLine(a)  # x: tokens computed, y: seconds
        self._skips = 0

    # -- measurements ------------------------------------------------------------------------------
    def observe_fetch(self, num_pages: int, nbytes: int, duration_s: float) -> None:
        """One host's ack of an L3 -> L2 op of ``num_pages`` pages."""
        if nbytes <= 0 or duration_s <= 0 or num_pages <= 0:
            return  # a failed or empty op says nothing about speed
        self._fetch.add(float(nbytes), duration_s)
        self._page_bytes.add(nbytes / num_pages)

    def observe_load(self, num_pages: int, nbytes: int, duration_s: float) -> None:
        """One host's ack of an L2 -> L1 op of ``num_pages`` pages."""
        if nbytes <= 0 or duration_s <= 0 or num_pages <= 0:
            return
        self._load_rate.add(nbytes / duration_s)
        self._page_bytes.add(nbytes / num_pages)

    def report_prefill(self, report: PrefillReport) -> None:
        """The serving side's measured prefill (one request's)."""
        if report.tokens and report.seconds > 0:
            self._prefill.add(float(report.tokens), report.seconds)

    # -- estimates ---------------------------------------------------------------------------------
    def _fetch_line(self) -> tuple[float, float]:
        o = self.options
        return self._fetch.fit(o.l3_latency_s, 1.0 / o.l3_bytes_per_s)

    def page_bytes(self) -> float:
        return self._page_bytes.get(self.options.page_bytes)

    def fetch_s(self, pages: int) -> float:
        if pages <= 0:
            return 0.0
        intercept, slope = self._fetch_line()
        return intercept + slope * pages * self.page_bytes()

    def _latency_floor(self, pending: PendingFetch | None) -> float:
        """The least first-byte latency an unacked fetch's age implies (0.0: it says nothing beyond the
        estimate): its age minus its bytes at the estimated rate, when that exceeds the estimate."""
        if pending is None or pending.pages <= 0:
            return 0.0
        intercept, slope = self._fetch_line()
        floor = pending.age_s - slope * pending.pages * self.page_bytes()
        return floor if floor > intercept else 0.0

    def load_s(self, pages: int) -> float:
        return pages * self.page_bytes() / self._load_rate.get(self.options.load_bytes_per_s)

    def _prefill_line(self) -> tuple[float, float]:
        return self._prefill.fit(0.0, 1.0 / self.options.prefill_tokens_per_s)

    def recompute_s(self, tokens: int) -> float:
        return tokens * self._prefill_line()[1]

    def choose(self, found: int, page_size: int, least: int, budget_s: float | None,
               pending: PendingFetch | None = None) -> FetchPlan:
        """How many of ``found`` leading pages to fetch. Loading n pages costs latency + n * per-page
        time; recomputing them n * per-token time: when a page loads faster than it computes, the more
        the better, up to what is back within ``budget_s`` (the request's wait; None: no request waits,
        the pages are for later ones); a part under ``least`` pages is not worth a fetch. Until a fetch
        and a prefill were measured, every page found is fetched (the defaults alone never skip one); an
        unacked fetch older than its estimate (``pending``) stands in for a measured one, its age a lower
        bound on the latency."""
        recompute = self.recompute_s(found * page_size)
        floor = self._latency_floor(pending) if self.options.enabled else 0.0
        if not self.options.enabled or not ((self._fetch.samples or floor) and self._prefill.samples):
            # the model skips on measured evidence only: until both sides were measured, fetch (and measure)
            return FetchPlan(found, self.fetch_s(found), self.load_s(found), recompute)
        intercept, slope = self._fetch_line()
        lift = max(0.0, floor - intercept)  # what the unacked fetch adds to the estimated latency
        intercept += lift
        per_page = slope * self.page_bytes() + self.load_s(1)
        gain = self.recompute_s(page_size) - self.options.margin * per_page
        n = found
        if budget_s is not None and per_page > 0:
            n = min(n, max(0, int((budget_s - intercept) / per_page)))
        load = self.options.margin * (self.fetch_s(n) + lift * (n > 0) + self.load_s(n))
        if gain <= 0 or n < least or load >= self.recompute_s(n * page_size):
            self._skips += 1
            every = self.options.explore_every
            if every and self._skips % every == 0 and found >= least:
                return FetchPlan(found, self.fetch_s(found) + lift, self.load_s(found), recompute, explored=True)
            return FetchPlan(0, self.fetch_s(n) + lift * (n > 0), self.load_s(n), recompute)
        return FetchPlan(n, self.fetch_s(n) + lift, self.load_s(n), recompute)

    @property
    def measured(self) -> bool:
        """Both sides were measured (an L3 fetch and a prefill): the model decides on evidence."""
        return bool(self._fetch.samples and self._prefill.samples)

    def wait_bound_s(self, pages: int, page_size: int) -> float | None:
        """How long a request may wait for a fetch of ``pages`` pages (None: no bound of the model's)."""
        o = self.options
        if not (o.enabled and o.wait_factor and self._prefill.samples):
            return None
        return o.wait_factor * self.recompute_s(pages * page_size)

    def snapshot(self) -> dict:
        """The current estimates (``cache_stats()["storage"]["cost_model"]``) and their sample counts."""
        intercept, slope = self._fetch_line()
        fixed, per_token = self._prefill_line()
        return {
            "enabled": self.options.enabled,
            "l3_latency_s": intercept,
            "l3_bytes_per_s": 1.0 / slope if slope > 0 else float("inf"),
            "load_bytes_per_s": self._load_rate.get(self.options.load_bytes_per_s),
            "prefill_tokens_per_s": 1.0 / per_token,
            "prefill_fixed_s": fixed,
            "page_bytes": self.page_bytes(),
            "fetch_samples": self._fetch.samples,
            "load_samples": self._load_rate.samples,
            "prefill_samples": self._prefill.samples,
        }
