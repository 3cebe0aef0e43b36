"""A corpus generated deterministically (no downloads), and batches addressed by step.

The text is a small synthetic language -- sentences from a fixed grammar with
agreement and a few long-range patterns -- so a small model's loss falls
visibly within a minute.  Its tokens are its characters; its last tenth is held out
for evaluation.  ``Corpus.batch(step)`` depends only on (seed, step), so resuming at
step N reads exactly the batches an uninterrupted run would.  (``--data`` files are
:mod:`zeropipe.apps.data.tokens`'s.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Corpus"]

_SUBJECTS = [
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "the robot",
    "a small bird",
    "our teacher",
]
_VERBS = ["sees", "likes", "finds", "follows", "paints", "hears", "remembers"]
_OBJECTS = [
    "the red ball",
    "a quiet river",
    "the tall tree",
    "an open door",
    "the blue sky",
    "a warm bed",
]
_PLACES = ["in the park", "at home", "near the sea", "after dinner", "every morning", "on monday"]


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
    if rng.random() < 0.5:
        s += f" {rng.choice(_PLACES)}"
    if rng.random() < 0.3:
        n = rng.randint(2, 5)
        s += ", counting " + " ".join(str(k) for k in range(1, n + 1))
    return s + ". "


@dataclass
class Corpus:
    """Character-level tokens of the generated text, ids into ``alphabet``."""

    tokens: Tensor
    alphabet: str

    @classmethod
    def generate(cls, chars: int = 200_000, seed: int = 0) -> Corpus:
        rng = random.Random(seed)
        parts: list[str] = []
        total = 0
        while total < chars:
            parts.append(_sentence(rng))
            total += len(parts[-1])
        text = "".join(parts)[:chars]
        alphabet = "".join(sorted(set(text)))
        index = {c: i for i, c in enumerate(alphabet)}
        return cls(torch.tensor([index[c] for c in text], dtype=torch.long), alphabet)

    @property
    def vocab(self) -> int:
        return len(self.alphabet)

    def batch(
        self, step: int, batch_size: int, seq: int, seed: int = 0, split: str = "train"
    ) -> tuple[Tensor, Tensor]:
        """Inputs and next-token targets for ``step``: random windows, fixed by (seed, step, split)."""
        cut = int(len(self.tokens) * 0.9)
        lo, hi = (0, cut) if split == "train" else (cut, len(self.tokens))
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = torch.randint(lo, hi - seq - 1, (batch_size,), generator=g)
        x = torch.stack([self.tokens[s : s + seq] for s in starts.tolist()])
        y = torch.stack([self.tokens[s + 1 : s + seq + 1] for s in starts.tolist()])
        return x, y

    def decode(self, ids: Tensor) -> str:
        return "".join(self.alphabet[i] for i in ids.tolist())
