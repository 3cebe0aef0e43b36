"""The one 2-process launch the Hugging Face adapter tests share: every architecture tied and
untied under every schedule (``hf_cases``), then the padded batches (``hf_mask_cases``), then
microbatches of different lengths (``hf_varlen_cases``).

One launch, cached for the test session: each process imports torch and transformers once
for every set of cases, and each set is read by its own test (test_hf.py, test_hf_mask.py,
test_hf_varlen.py).
"""

from __future__ import annotations

import functools
from typing import Any

import zeropipe
from tests.adapters import hf_cases, hf_mask_cases, hf_varlen_cases

LAUNCH_TIMEOUT = 600.0


def cases(rank: int, world: int) -> dict[str, Any]:
    """Per rank: ``{"unpadded": ..., "padded": ..., "microbatches": ...}``, each what its
    cases module returns."""
    return {
        "unpadded": hf_cases.distributed_cases(rank, world),
        "padded": hf_mask_cases.distributed_cases(rank, world),
        "microbatches": hf_varlen_cases.distributed_cases(rank, world),
    }


@functools.cache
def results() -> list[dict[str, Any]]:
    """``cases`` on 2 processes, launched once per test session."""
    return zeropipe.launch(cases, 2, timeout=LAUNCH_TIMEOUT)
