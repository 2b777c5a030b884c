"""The breaker of one storage location: stop asking an endpoint that does not answer.

States (``BreakerState``):

- ``closed``: every call goes to the backend. A round of operations (one ``BatchIO`` batch) in
  which any operation timed out or could not connect is a failure, also when others of the round
  got an answer (a hang that costs a request its deadline counts however many calls it shares the
  round with). A storage call that makes several rounds (a listing, then existence checks) counts
  one failure at most (``record(repeat=True)`` for its later failed rounds), so ``threshold`` is a
  number of failed calls whatever their rounds. ``threshold`` failures within ``window_s`` open the
  breaker, whatever clean rounds (answers only: data, "not found", a lost write race, a corrupt object) came between: an
  endpoint that hangs on a fraction of calls opens it too (with a reset on every clean round,
  small backup rounds kept a 20% hang rate from ever opening it), and a rare timeout of a healthy
  one leaves the window. A round in which every operation could not connect (connection
  refused: certain, nothing listens) opens it at once.
- ``open``: calls fail fast (``StorageUnavailableError``, counted as ``unavailable``) without
  touching the network, for ``cooldown_s``.
- ``half_open``: after the cooldown, one call (the probe) goes through; the others keep failing
  fast while it runs. A probe round with an answer and nothing timed out or refused closes the
  breaker; any other opens it for another cooldown.

One ``Breaker`` per ``FsspecStorage`` (one per URL root and process). Any thread may call it (one
lock); ``clock`` is injectable so tests move time instead of sleeping.
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from collections.abc import Callable


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    def __init__(self, threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 window_s: float = 10.0) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
            raise ValueError(f"threshold must be an int >= 1, got {threshold!r}")
        if isinstance(cooldown_s, bool) or not isinstance(cooldown_s, (int, float)) or not cooldown_s >= 0:
            raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
        if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.threshold = threshold
        self.cooldown_s = float(cooldown_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self.window_s = float(window_s)
        self._failures: collections.deque[float] = collections.deque()  # times of failures (calls) while closed
        self._opened_at = 0.0
        self.opens = 0  # times the breaker opened (closed/half-open -> open)

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Read time from ``clock`` from now on, keeping how long ago the breaker opened and its
        failures were (a test's manual clock, swapped in after the store already ran calls)."""
        with self._lock:
            shift = clock() - self.clock()
            self.clock = clock
            self._opened_at += shift
            self._failures = collections.deque(t + shift for t in self._failures)

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker past its cooldown reads ``half_open``: a call would probe)."""
        with self._lock:
            if self._state is BreakerState.OPEN and self.clock() >= self._opened_at + self.cooldown_s:
                return BreakerState.HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """Whether a call may go to the backend now; True for exactly one probe after a cooldown
        (the caller must then ``record`` the round's outcome)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self.clock() >= self._opened_at + self.cooldown_s:
                self._state = BreakerState.HALF_OPEN  # this caller is the probe
                return True
            return False

    def record(self, *, answered: bool, tripped: bool, refused: bool = False, repeat: bool = False) -> None:
        """Outcome of a round that ``allow`` let through: ``answered`` if any operation got an
        answer from the backend, ``tripped`` if any timed out or could not connect, ``refused``
        if every one could not connect; ``repeat`` if an earlier round of the same call already
        counted a failure (this one then does not count again while closed)."""
        with self._lock:
            if self._state is BreakerState.HALF_OPEN:  # the probe (or a round begun before it)
                if answered and not tripped:
                    self._state = BreakerState.CLOSED
                    self._failures.clear()
                else:
                    self._open_locked()
            elif self._state is BreakerState.CLOSED:
                if refused:
                    self._open_locked()
                elif tripped and not repeat:
                    now = self.clock()
                    self._failures.append(now)
                    while self._failures[0] < now - self.window_s:
                        self._failures.popleft()
                    if len(self._failures) >= self.threshold:
                        self._open_locked()
            # OPEN: a round that started before the breaker opened changes nothing

    def _open_locked(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self.clock()
        self._failures.clear()
        self.opens += 1
