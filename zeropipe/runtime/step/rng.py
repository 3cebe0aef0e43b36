"""Per-(step, microbatch, layer) seeding, so randomness does not depend on the schedule.

Dropout masks must be the same whatever order the schedule runs microbatches
in, and whatever the number of ranks: each layer draws from a generator
seeded by ``(seed, step, microbatch, key)``, ``key`` being its index in the
whole model (a Sequential's layer, or a submodule a stage names with
``runtime.stage.seed_layers``); what a hand-made stage draws outside such
layers is keyed by the stage index, and so depends on the cut.
The caller's global RNG state is saved once per step and restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["derive_seed", "preserved_rng", "seeded"]

_MASK = (1 << 63) - 1


def derive_seed(seed: int, step: int, microbatch: int, key: int) -> int:
    """A 63-bit seed from the four integers (splitmix64 mixing, stable across runs)."""
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9) & _MASK
    x = (x ^ (microbatch * 0x94D049BB133111EB) ^ (key * 0xD6E8FEB86659FD93)) & _MASK
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    return x & _MASK


def seeded(seed: int, step: int, microbatch: int, key: int, device: torch.device) -> None:
    """Seed the CPU generator and ``device``'s for one layer's forward of one microbatch.

    The generators are seeded directly: ``torch.manual_seed`` queues a lazy
    seeding call per accelerator with a captured stack trace, which costs about
    a millisecond -- too much to pay per layer per microbatch.
    """
    value = derive_seed(seed, step, microbatch, key)
    torch.default_generator.manual_seed(value)
    if device.type != "cpu":
        module = torch.get_device_module(device.type)
        index = device.index if device.index is not None else module.current_device()
        module.default_generators[index].manual_seed(value)


@contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Restore the CPU RNG state, and ``device``'s if it is an accelerator, on exit."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            yield
    else:
        index = device.index if device.index is not None else 0
        with torch.random.fork_rng(devices=[index], device_type=device.type):
            yield
