"""What each rank runs in the step-agreement tests (tests/runtime/transport/test_step_agreement.py).

Ranks and replicas that are not in the same step, or not on the same batch, must fail fast.
``two_ranks`` (both transports, one pipeline of 2 ranks) runs last in the 2-rank launch of
tests/runtime/dist_cases.py, ``four_ranks`` (2 pipeline ranks x 2 replicas) last in the
4-process launch of tests/runtime/dp_cases.py: each case builds its own pipeline and starts
with a barrier, so a failed one poisons nothing after it, and its seconds are its own.
``ended_early`` ends the launch of its own test.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import generate
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions
from zeropipe.runtime.transport.base import Transport
from zeropipe.runtime.transport.ordered import OrderedTransport
from zeropipe.runtime.transport.tagged import DistributedTransport

TIMEOUT = 20.0  # seconds a rank waits for a peer: every failure here must come far sooner
P2P = ("tagged", "ordered")


def plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def batch(rows: int, seed: int) -> tuple[Tensor, Tensor]:
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
    model = plain_model()
    options = RuntimeOptions(p2p=p2p, timeout=TIMEOUT)  # type: ignore[arg-type]
    return model, Pipeline(
        model, "1f1b", F.mse_loss, microbatches=2, balance=[3, 2], mesh=mesh, options=options
    )


def _steps(pipe: Pipeline, calls: list[tuple[str, int]]) -> list[float]:
    """Run ``calls`` (("step" | "eval", rows), ...), batch k seeded by k; the losses."""
    losses = []
    for k, (kind, rows) in enumerate(calls):
        x, y = batch(rows, k)
        loss = pipe.step(x, y) if kind == "step" else pipe.eval_step(x, y)
        assert isinstance(loss, Tensor)
        losses.append(loss.item())
    return losses


# -- 2 ranks, one pipeline --------------------------------------------------------------
AGREED = [("step", 8), ("step", 6), ("eval", 6), ("step", 8), ("eval", 8), ("step", 8)]
# What each rank calls: rank 1 skips the second call (a batch of 6 rows where the others
# are 8), is given a batch of other shapes, or evaluates where rank 0 trains.
CASES: dict[str, tuple[list[tuple[str, int]], list[tuple[str, int]]]] = {
    "agreed": (AGREED, AGREED),
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


def ended_early(rank: int, world: int) -> list[float]:
    """Rank 1's program ends after two steps, while rank 0 makes a third."""
    _, pipe = _pipeline("tagged")
    return _steps(pipe, [("step", 8)] * (3 if rank == 0 else 2))


def two_ranks(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for p2p in P2P:
        for name, calls in CASES.items():
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


# -- 2 pipeline ranks x 2 replicas ------------------------------------------------------
def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))


def owned_grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _replica_step(
    model: nn.Module, pipe: Pipeline, rank: int, rows: int
) -> tuple[float, dict[str, Tensor]]:
    x, y = batch(14, 0)
    # Replica d's pipeline is ranks d and 2 + d; replica 0 gets the first 8 rows.
    part = slice(0, 8) if rank % 2 == 0 else slice(8, 8 + rows)
    return pipe.step(x[part], y[part]).item(), owned_grads(model)


def four_ranks(rank: int, world: int) -> dict[str, Any]:
    mesh = _mesh()
    results: dict[str, Any] = {}
    # Replicas' slices may differ in rows: each is weighted as its share of the global batch.
    # Then rank 3, replica 1's second pipeline rank, is given 4 rows where rank 1 has 6.
    for name, rows in {"uneven": 6, "mismatch": 4 if rank == 3 else 6}.items():
        model, pipe = _pipeline("tagged", mesh)
        dist.barrier()
        results[name] = _timed(functools.partial(_replica_step, model, pipe, rank, rows))
    return results
