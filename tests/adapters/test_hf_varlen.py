"""A split Hugging Face Llama over microbatches of different lengths (``zeropipe.Microbatches``
of packed dict batches): the unsplit model's loss and gradients on every generator, and on
two processes over both point-to-point protocols (the shared launch of ``hf_two_processes``)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

from tests.adapters import hf_cases, hf_two_processes, hf_varlen_cases
from tests.runtime.step.test_microbatches import NAMES


def test_every_generator_gives_the_unsplit_models_loss_and_gradients() -> None:
    n = len(list(hf_cases.build("llama", tied=True).parameters()))
    for name in NAMES:
        worst = hf_varlen_cases.errors(name)
        assert worst["loss"] <= hf_cases.TOL and worst["grad"] <= hf_cases.TOL, (name, worst)
        assert worst["checked"] == len(hf_varlen_cases.STEPS) * n, (name, worst)


def test_two_processes_microbatches_of_different_lengths() -> None:
    results = [r["microbatches"] for r in hf_two_processes.results()]
    n = len(list(hf_cases.build("llama", tied=True).parameters()))
    for p2p in ("tagged", "ordered"):
        both = [r[p2p] for r in results]
        assert max(w["loss"] for w in both) <= hf_cases.TOL, (p2p, both)
        assert max(w["grad"] for w in both) <= hf_cases.TOL, (p2p, both)
        # the tied embedding's gradient is on both ranks
        assert sum(w["checked"] for w in both) >= len(hf_varlen_cases.STEPS) * n, (p2p, both)
