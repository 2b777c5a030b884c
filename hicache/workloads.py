"""Synthetic serving workloads shared by the demo, the benchmarks and the tests.

Pure numpy, deterministic from a seed. A workload is a list of rounds; each round is a list of
``Turn`` (the request's full prompt and the output the model will produce), shuffled within the round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class MultiTurnSpec:
    conversations: int = 200
    turns: int = 8
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (1024, 2048)  # inclusive range
    user_tokens: tuple[int, int] = (50, 300)
    output_tokens: tuple[int, int] = (100, 400)
    vocab_size: int = 32_000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "system_prompts", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "user_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"{name} must be a range 0 <= lo <= hi, got {(lo, hi)}")


@dataclass(frozen=True, eq=False)
class Turn:
    conversation: int
    round: int
    prompt: np.ndarray  # i32[prompt_len]: system prompt + all earlier turns + this turn's user tokens
    output: np.ndarray  # i32[output_len]

    @property
    def sequence(self) -> np.ndarray:
        return np.concatenate([self.prompt, self.output])


def multi_turn(spec: MultiTurnSpec) -> list[list[Turn]]:
    """Conversation c uses system prompt c mod ``system_prompts``; returns rounds of shuffled turns."""
    rng = np.random.default_rng(spec.seed)

    def tokens(bounds: tuple[int, int]) -> np.ndarray:
        n = int(rng.integers(bounds[0], bounds[1] + 1))
        return rng.integers(0, spec.vocab_size, size=n, dtype=np.int32)

    systems = [tokens(spec.system_tokens) for _ in range(spec.system_prompts)]
    history = [systems[c % spec.system_prompts] for c in range(spec.conversations)]
    rounds: list[list[Turn]] = []
    for r in range(spec.turns):
        this_round = []
        for c in range(spec.conversations):
            prompt = np.concatenate([history[c], tokens(spec.user_tokens)])
            output = tokens(spec.output_tokens)
            this_round.append(Turn(c, r, prompt, output))
            history[c] = np.concatenate([prompt, output])
        order = rng.permutation(len(this_round))
        rounds.append([this_round[i] for i in order])
    return rounds
