"""Ranks and replicas that are not in the same step, or not on the same batch, fail fast.

Every rank of a pipeline must call ``step`` (and ``eval_step``) alike, once per
step, with the same batch; each replica with its own slice of the global batch.
A rank that skips a step, or is given a batch of other shapes, must end every
rank within moments with one line naming both ranks and both steps or
batches, not be paired with the wrong step's messages until a timeout (or
until gloo aborts a process that received more bytes than it posted for).

The cases (tests/runtime/transport/agreement_cases.py) run last in two shared launches:
the 2-rank one of tests/runtime/dist_cases.py (both transports, over gloo) and the
4-process one of tests/runtime/dp_cases.py (2 pipeline ranks x 2 replicas).  Each case
builds its own pipeline, so a failed one poisons nothing after it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.runtime import dist_cases, dp_cases
from tests.runtime.transport import agreement_cases as cases
from tests.runtime.transport.agreement_cases import P2P, TIMEOUT
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.launch import launch

FAST = TIMEOUT / 4
LAUNCH_TIMEOUT = 240.0
FIX = "every rank of a pipeline must call step() and eval_step() alike, once per step"


def _agreement(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's agreement cases from a shared launch's results."""
    for rank, out in enumerate(results):
        assert "crashed" not in out["agreement"], (rank, out["agreement"]["crashed"])
    return [out["agreement"] for out in results]


def _outs(key: str) -> list[dict[str, Any]]:
    outs = [r[key] for r in _agreement(dist_cases.main_results(2))]
    for rank, out in enumerate(outs):
        assert not (out["error"] or "").startswith("crashed"), (rank, out["error"])
    return outs


def _assert_out_of_step(key: str, *parts: str) -> None:
    """Every rank failed fast, with the one line that names both ranks, ``parts`` and the fix."""
    for rank, out in enumerate(_outs(key)):
        error = out["error"]
        assert error is not None, (key, rank, out)
        assert "\n" not in error, (key, rank, error)
        assert "rank 0" in error and "rank 1" in error, (key, rank, error)
        assert "are not in the same step" in error and FIX in error, (key, rank, error)
        for part in parts:
            assert part in error, (key, rank, part, error)
        assert out["seconds"] < FAST, (key, rank, out["seconds"], error)


@pytest.mark.parametrize("p2p", P2P)
def test_ranks_that_make_the_same_calls_agree_whatever_the_batch_size_and_kind(p2p: str) -> None:
    outs = _outs(f"{p2p}/agreed")
    assert outs[0]["error"] is None and outs[1]["error"] is None, outs
    assert outs[0]["result"] == outs[1]["result"], outs
    model = cases.plain_model()
    for k, (_, rows) in enumerate(cases.AGREED):  # the loss is the plain model's, step by step
        x, y = cases.batch(rows, k)
        with torch.no_grad():
            want = F.mse_loss(model(x), y).item()
        assert abs(outs[0]["result"][k] - want) < 1e-5, (k, outs[0]["result"], want)


@pytest.mark.parametrize("p2p", P2P)
def test_a_rank_that_skips_a_step_fails_every_rank_fast_naming_both_batches(p2p: str) -> None:
    # Rank 1's second call gets rank 0's third batch: 8 rows where rank 0 has 6.
    _assert_out_of_step(
        f"{p2p}/skip",
        "training step 1 on inputs float32[3, 4] per microbatch, target float32[6, 2]",
        "training step 1 on inputs float32[4, 4] per microbatch, target float32[8, 2]",
    )


@pytest.mark.parametrize("p2p", P2P)
@pytest.mark.parametrize("when", ["shape", "shape-later"])
def test_a_rank_given_a_batch_of_other_shapes_fails_every_rank_fast(p2p: str, when: str) -> None:
    step, rows = (0, 6) if when == "shape" else (1, 12)
    _assert_out_of_step(
        f"{p2p}/{when}",
        f"training step {step} on inputs float32[4, 4] per microbatch, target float32[8, 2]",
        f"training step {step} on inputs float32[{rows // 2}, 4] per microbatch, "
        f"target float32[{rows}, 2]",
    )


@pytest.mark.parametrize("p2p", P2P)
def test_a_rank_that_evaluates_where_its_peer_trains_fails_every_rank_fast(p2p: str) -> None:
    _assert_out_of_step(
        f"{p2p}/eval",
        "training step 1 on inputs float32[4, 4]",
        "an evaluation step (after 1 training steps) on inputs float32[4, 4]",
    )


@pytest.mark.parametrize("p2p", P2P)
@pytest.mark.parametrize("where", ["header", "barrier"])
def test_a_rank_one_step_later_fails_every_rank_fast_naming_both_steps(
    p2p: str, where: str
) -> None:
    mine, theirs = (5, 4) if where == "header" else (1, 2)
    _assert_out_of_step(f"{p2p}/later-{where}", f"step {mine}", f"step {theirs}")


def test_a_rank_whose_program_ends_early_is_named_as_such() -> None:
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        launch(cases.ended_early, 2, timeout=LAUNCH_TIMEOUT)
    msg = str(err.value)
    # gloo sees the connection close, whether the peer ended or died; what the step was says more
    assert msg.startswith("rank 0 failed: rank 1 stopped responding (killed?) while rank 0"), msg
    assert (
        "rank 0 was in training step 2, and rank 1 had ended the step before it: if rank 1's "
        "program ended there, it called step() or eval_step() fewer times; every rank of a "
        "pipeline must call them alike, once per step, with the same batch"
    ) in msg, msg
    assert time.monotonic() - start < LAUNCH_TIMEOUT / 2


# -- 2 pipeline ranks x 2 replicas ------------------------------------------------------
def _four_rank_results() -> list[dict[str, Any]]:
    return _agreement(dp_cases.results())


def test_replicas_with_slices_of_different_rows_give_the_global_batch() -> None:
    outs = [r["uneven"] for r in _four_rank_results()]
    model = cases.plain_model()
    x, y = cases.batch(14, 0)
    want = F.mse_loss(model(x), y)
    want.backward()
    ref = cases.owned_grads(model)
    for rank, out in enumerate(outs):
        assert out["error"] is None, (rank, out)
        loss, grads = out["result"]
        assert abs(loss - want.item()) < 1e-6, (rank, loss, want.item())
        for name, grad in grads.items():
            assert torch.allclose(grad, ref[name], atol=1e-6), (rank, name)


def test_a_pipeline_rank_of_one_replica_given_other_rows_fails_every_rank_fast() -> None:
    outs = [r["mismatch"] for r in _four_rank_results()]
    for rank, out in enumerate(outs):
        error = out["error"]
        assert error is not None, (rank, out)
        assert "\n" not in error and "crashed" not in error, (rank, error)
        # The pipeline ranks are numbered in the pipeline's group: ranks 1 and 3 are its 0 and 1.
        assert "rank 0 and rank 1 are not in the same step" in error or (
            "rank 1 and rank 0 are not in the same step" in error
        ), (rank, error)
        assert "target float32[6, 2]" in error and "target float32[4, 2]" in error, error
        assert FIX in error, (rank, error)
        assert out["seconds"] < FAST, (rank, out["seconds"], error)
