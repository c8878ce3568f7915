"""The demo's verifiable task: reverse a string of digits. Rewards are computed by code.

A prompt is ``"<digits>="``; the right completion is the digits reversed. The reward is the fraction of
positions answered right (extra or missing characters count as wrong), so a group of samples has spread
for group-relative advantages even before the policy is good.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


class ReverseDigits:
    def __init__(self, *, min_len: int = 3, max_len: int = 6, seed: int = 0) -> None:
        self.min_len, self.max_len = min_len, max_len
        self.rng = random.Random(seed)

    def sample(self) -> Problem:
        n = self.rng.randint(self.min_len, self.max_len)
        digits = "".join(self.rng.choice("0123456789") for _ in range(n))
        return Problem(prompt=f"{digits}=", answer=digits[::-1])

    @staticmethod
    def reward(problem: Problem, completion: str) -> float:
        text = completion.strip()
        want = problem.answer
        right = sum(1 for a, b in zip(text, want, strict=False) if a == b)
        return right / max(len(want), len(text), 1)
