"""Ranks and replicas that are not in the same step, or not on the same batch, fail fast.

Every rank of a pipeline must call ``step`` (and ``eval_step``) alike, once per
step, with the same batch; each replica with its own slice of the global batch.
A rank that skips a step, or is given a batch of other shapes, must end every
rank within moments with one line naming both ranks and both steps or
batches, not be paired with the wrong step's messages until a timeout (or
until gloo aborts a process that received more bytes than it posted for).

Two launches: 2 processes (both transports, over gloo) and 4 (2 pipeline
ranks x 2 replicas).  Each case builds its own pipeline, so a failed one
poisons nothing after it.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import generate
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions
from zeropipe.runtime.transport.base import Transport
from zeropipe.runtime.transport.ordered import OrderedTransport
from zeropipe.runtime.transport.tagged import DistributedTransport

TIMEOUT = 20.0  # seconds a rank waits for a peer: every failure here must come far sooner
FAST = TIMEOUT / 4
LAUNCH_TIMEOUT = 240.0
P2P = ("tagged", "ordered")
FIX = "every rank of a pipeline must call step() and eval_step() alike, once per step"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(rows: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)


def _timed(fn: Callable[[], object]) -> dict[str, Any]:
    """What ``fn`` ended with: its result or its PipelineError's message, and how long it took."""
    start = time.monotonic()
    out: dict[str, Any] = {"error": None, "result": None}
    try:
        out["result"] = fn()
    except PipelineError as err:
        out["error"] = str(err)
    except Exception:
        out["error"] = "crashed: " + traceback.format_exc()
    out["seconds"] = time.monotonic() - start
    return out


def _pipeline(p2p: str, mesh: Any = None) -> tuple[nn.Sequential, Pipeline]:
    model = _model()
    options = RuntimeOptions(p2p=p2p, timeout=TIMEOUT)  # type: ignore[arg-type]
    return model, Pipeline(
        model, "1f1b", F.mse_loss, microbatches=2, balance=[3, 2], mesh=mesh, options=options
    )


def _steps(pipe: Pipeline, calls: list[tuple[str, int]]) -> list[float]:
    """Run ``calls`` (("step" | "eval", rows), ...), batch k seeded by k; the losses."""
    losses = []
    for k, (kind, rows) in enumerate(calls):
        x, y = _batch(rows, k)
        loss = pipe.step(x, y) if kind == "step" else pipe.eval_step(x, y)
        assert isinstance(loss, Tensor)
        losses.append(loss.item())
    return losses


# -- 2 ranks, one pipeline --------------------------------------------------------------
_AGREED = [("step", 8), ("step", 6), ("eval", 6), ("step", 8), ("eval", 8), ("step", 8)]
# What each rank calls: rank 1 skips the second call (a batch of 6 rows where the others
# are 8), is given a batch of other shapes, or evaluates where rank 0 trains.
_CASES: dict[str, tuple[list[tuple[str, int]], list[tuple[str, int]]]] = {
    "agreed": (_AGREED, _AGREED),
    "skip": ([("step", 8), ("step", 6), ("step", 8)], [("step", 8), ("step", 8)]),
    "shape": ([("step", 8)], [("step", 6)]),
    "shape-later": ([("step", 8), ("step", 8)], [("step", 8), ("step", 12)]),
    "eval": ([("step", 8), ("step", 8)], [("step", 8), ("eval", 8)]),
}


def _transport(rank: int, p2p: str) -> Transport:
    schedule = lower(generate("1f1b", 2, 1))
    if p2p == "tagged":
        return DistributedTransport(schedule, rank, timeout=TIMEOUT)
    return OrderedTransport(schedule, rank, timeout=TIMEOUT)


def _transport_steps(t: Transport, rank: int, steps: list[int]) -> list[float]:
    """The transport alone, told the pipeline's step numbers: ``steps`` per call."""
    schedule = lower(generate("1f1b", 2, 1))
    sig = ((torch.float32, (2, 3)),)
    out = []
    for step in steps:
        t.start_step(schedule, sig, step=step)
        try:
            if rank == 0:
                t.send(Action(Kind.SEND_F, 0, 0), (torch.full((2, 3), float(step)),))
                t.post_recv(Action(Kind.RECV_B, 0, 0))
                got = t.wait_recv(Action(Kind.RECV_B, 0, 0))[0]
            else:
                t.post_recv(Action(Kind.RECV_F, 1, 0))
                got = t.wait_recv(Action(Kind.RECV_F, 1, 0))[0]
                t.send(Action(Kind.SEND_B, 1, 0), (got + 1,))
            t.finish_step()
        except BaseException as exc:
            t.fail(exc)
            raise
        out.append(got.sum().item())
    return out


def _ended_early(rank: int, world: int) -> list[float]:
    """Rank 1's program ends after two steps, while rank 0 makes a third."""
    _, pipe = _pipeline("tagged")
    return _steps(pipe, [("step", 8)] * (3 if rank == 0 else 2))


def _two_ranks(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for p2p in P2P:
        for name, calls in _CASES.items():
            _, pipe = _pipeline(p2p)
            dist.barrier()  # each case starts together: the seconds are its own
            results[f"{p2p}/{name}"] = _timed(functools.partial(_steps, pipe, calls[rank]))
        # One step later: the pipeline's step numbers (restored on resume) differ, first in
        # a step that sends shape headers, then in one that sends payloads alone.
        for name, steps in {"header": [[5], [4]], "barrier": [[0, 1], [0, 2]]}.items():
            t = _transport(rank, p2p)
            dist.barrier()
            results[f"{p2p}/later-{name}"] = _timed(
                functools.partial(_transport_steps, t, rank, steps[rank])
            )
    return results


@functools.cache
def _two_rank_results() -> list[dict[str, Any]]:
    return launch(_two_ranks, 2, timeout=LAUNCH_TIMEOUT)


def _outs(key: str) -> list[dict[str, Any]]:
    outs = [r[key] for r in _two_rank_results()]
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
    model = _model()
    for k, (_, rows) in enumerate(_AGREED):  # the loss is the plain model's, step by step
        x, y = _batch(rows, k)
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
        launch(_ended_early, 2, timeout=LAUNCH_TIMEOUT)
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
def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _replica_step(
    model: nn.Module, pipe: Pipeline, rank: int, rows: int
) -> tuple[float, dict[str, Tensor]]:
    x, y = _batch(14, 0)
    # Replica d's pipeline is ranks d and 2 + d; replica 0 gets the first 8 rows.
    part = slice(0, 8) if rank % 2 == 0 else slice(8, 8 + rows)
    return pipe.step(x[part], y[part]).item(), _grads(model)


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    mesh = _mesh()
    results: dict[str, Any] = {}
    # Replicas' slices may differ in rows: each is weighted as its share of the global batch.
    # Then rank 3, replica 1's second pipeline rank, is given 4 rows where rank 1 has 6.
    for name, rows in {"uneven": 6, "mismatch": 4 if rank == 3 else 6}.items():
        model, pipe = _pipeline("tagged", mesh)
        dist.barrier()
        results[name] = _timed(functools.partial(_replica_step, model, pipe, rank, rows))
    return results


@functools.cache
def _four_rank_results() -> list[dict[str, Any]]:
    return launch(_four_ranks, 4, timeout=LAUNCH_TIMEOUT)


def test_replicas_with_slices_of_different_rows_give_the_global_batch() -> None:
    outs = [r["uneven"] for r in _four_rank_results()]
    model = _model()
    x, y = _batch(14, 0)
    want = F.mse_loss(model(x), y)
    want.backward()
    ref = _grads(model)
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
