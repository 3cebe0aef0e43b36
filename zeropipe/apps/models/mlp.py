"""The benchmark model: blocks of Linear(d, 4d)-GELU-Linear(4d, d) as an ``nn.Sequential``."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["mlp_blocks"]


def mlp_blocks(
    blocks: int = 8, width: int = 512, hidden: int = 2048, *, seed: int = 0
) -> nn.Sequential:
    """``blocks`` x (Linear(width, hidden), GELU, Linear(hidden, width)), seeded."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        return nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
                for _ in range(blocks)
            ]
        )
    finally:
        torch.random.set_rng_state(state)
