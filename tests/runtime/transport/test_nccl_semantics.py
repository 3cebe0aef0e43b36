"""The ordered protocol under NCCL's point-to-point semantics, emulated over gloo.

No machine here has two GPUs, so NCCL itself cannot run: ``nccl_emulation``
makes gloo behave as NCCL does (tags ignored, one in-order stream per
process, a posted receive blocking what follows, sends completing only when
received, batches progressing together).  Under it, every generator on 2 and
4 ranks, with grouped W, recompute and offload, runs the float64 model to the
unpipelined loss and gradients over steps whose batch size and sequence
length change, with ``p2p="ordered"``; the tagged protocol, under the same
emulation, fails (which shows the emulation bites).  One launch per world
size runs every case.
"""

from __future__ import annotations

import functools
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.gradcheck import mlp, reference
from tests.runtime.nccl_emulation import NcclSemantics
from zeropipe.core.costs import CostModel
from zeropipe.core.errors import PipelineError, ScheduleError
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.passes.fit import checkpoint, offload, offload_weights
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.planning.plan import auto_plan
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

WORLDS = (2, 4)
TIMEOUT = 30.0
WIDTH = 8
# (batch, sequence length) of each step: both change, then the first comes back.
STEPS = ((11, 3), (13, 5), (11, 3))
PLAIN = ("gpipe", "1f1b", "zbv", "interleaved-zb")  # also run over plain gloo


def _supported(name: str, world: int, m: int) -> bool:
    try:
        generate(name, world, m)
    except ScheduleError as err:
        if err.rule != "unsupported":
            raise
        return False
    return True


def _batch(batch: int, seq: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * batch + seq + step)
    x = torch.randn(batch, seq, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(batch, seq, WIDTH, generator=g, dtype=torch.float64)


def _run(
    schedule: Any,
    world: int,
    m: int,
    p2p: str,
    timeout: float,
    group_w: int = 1,
    device: str | None = None,
) -> dict[str, Any]:
    """Steps of the float64 model under ``schedule``: worst loss and gradient differences."""
    model = mlp(layers=2 * world * 2, width=WIDTH)
    if schedule == "auto":  # searched under given costs, alike on every rank
        schedule = auto_plan(model, world, m, costs=CostModel.uniform(world)).schedule
    if isinstance(schedule, str):
        schedule = build_schedule(schedule, ranks=world, microbatches=m, group_w=group_w)
    pipe = Pipeline(
        model,
        schedule,
        loss_fn=F.mse_loss,
        options=RuntimeOptions(timeout=timeout, p2p=p2p, device=device),  # type: ignore[arg-type]
    )
    owned = {id(p) for p in pipe.parameters()}
    worst_loss = worst_grad = 0.0
    for step, (batch, seq) in enumerate(STEPS):
        x, y = _batch(batch, seq, step)
        ref_loss, ref = reference(model, x, y, F.mse_loss, m)
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        worst_loss = max(worst_loss, abs(loss.item() - ref_loss.item()))
        for n, p in model.named_parameters():
            if id(p) in owned:
                assert p.grad is not None, n
                worst_grad = max(worst_grad, (p.grad - ref[n]).abs().max().item())
    return {"loss": worst_loss, "grad": worst_grad, "transport": type(pipe.transport).__name__}


def _guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return {"crashed": traceback.format_exc()}


def schedules(world: int) -> dict[str, tuple[Any, int, dict[str, Any]]]:
    """Every case: name -> (schedule, microbatches, Pipeline keywords)."""
    m = 2 * world + 1
    out: dict[str, tuple[Any, int, dict[str, Any]]] = {
        name: (name, m, {}) for name in sorted(GENERATORS) if _supported(name, world, m)
    }
    out["1f1b/m=1"] = ("1f1b", 1, {})
    out["zbv/group_w=2"] = ("zbv", m, {"group_w": 2})
    out["interleaved-1f1b/group_w=3"] = ("interleaved-1f1b", m, {"group_w": 3})
    base = generate("1f1b", world, m)
    out["1f1b+recompute"] = (
        checkpoint(base, [(s, i) for s in range(world) for i in (0, 2)]),
        m,
        {},
    )
    out["1f1b+offload"] = (offload(base, [(s, i) for s in range(world - 1) for i in (1, 3)]), m, {})
    out["1f1b+weight-offload"] = (offload_weights(base, [0]), m, {"device": "cpu"})
    return out


def nccl_cases(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with NcclSemantics(timeout=TIMEOUT) as emulation:
        for name, (schedule, m, kw) in schedules(world).items():
            out[name] = _guard(
                functools.partial(_run, schedule, world, m, "ordered", TIMEOUT, **kw)
            )
        out["calls"] = emulation.calls
    # And on gloo as it is (tags kept, receives independent, a work waited on once).
    for name in PLAIN:
        if _supported(name, world, 2 * world + 1):
            run = functools.partial(_run, name, world, 2 * world + 1, "ordered", TIMEOUT)
            out[f"plain/{name}"] = _guard(run)
    return out


def tagged_case(rank: int, world: int) -> dict[str, Any]:
    """The tagged protocol under the emulation: gloo aborts on a mismatched message, or a
    rank times out waiting; if it ran to the end, its figures are returned."""
    with NcclSemantics(timeout=6.0):
        return _run("1f1b", world, 2 * world + 1, "tagged", 3.0)


@functools.cache
def _results(world: int) -> list[dict[str, Any]]:
    return launch(nccl_cases, world, timeout=300.0)


@pytest.mark.parametrize("world", WORLDS)
def test_every_schedule_is_exact_under_nccl_semantics(world: int) -> None:
    results = _results(world)
    names = list(schedules(world)) + [
        f"plain/{n}" for n in PLAIN if _supported(n, world, 2 * world + 1)
    ]
    assert len(names) >= len(GENERATORS) - 2  # every generator that supports this world
    for rank, out in enumerate(results):
        assert out["calls"] > 0, "the emulation was never used"
        for name in names:
            got = out[name]
            assert "crashed" not in got, f"rank {rank}, {name}:\n{got.get('crashed')}"
            assert got["transport"] == "OrderedTransport"
            assert got["loss"] < 1e-12 and got["grad"] < 1e-12, (rank, name, got)


@pytest.mark.parametrize("world", WORLDS)
def test_the_tagged_protocol_fails_under_nccl_semantics(world: int) -> None:
    # The same model and steps as the ordered cases, which pass under the same emulation.
    start = time.monotonic()
    try:
        results = launch(tagged_case, world, timeout=120.0, grace=2.0)
    except PipelineError as err:
        text = str(err)
        assert any(w in text for w in ("size doesn't match", "timeout", "SIGABRT", "mismatch")), (
            text
        )
    else:
        worst = max(max(r["loss"], r["grad"]) for r in results)
        assert worst > 1e-9, f"the tagged protocol ran exactly under NCCL semantics: {results}"
    assert time.monotonic() - start < 90


def test_p2p_must_be_a_known_mode() -> None:
    with pytest.raises(PipelineError, match="p2p must be 'auto', 'ordered' or 'tagged'"):
        Pipeline(
            mlp(layers=4),
            "1f1b",
            loss_fn=F.mse_loss,
            microbatches=2,
            options=RuntimeOptions(p2p="fast"),
        )  # type: ignore[arg-type]


def test_order_is_consistent_for_every_generator() -> None:
    from zeropipe.core.message_order import message_order, receiver_of

    for world in WORLDS:
        for name in sorted(GENERATORS):
            m = 2 * world + 1
            if not _supported(name, world, m):
                continue
            schedule = build_schedule(name, ranks=world, microbatches=m)
            order = message_order(schedule)
            # Each pair's messages: the sender's order is the receiver's order.
            for a in range(world):
                for b in range(world):
                    sent = [x for x in order[a] if x.kind.name.startswith("SEND")
                            and schedule.placement[receiver_of(x).stage] == b]  # fmt: skip
                    got = [x for x in order[b] if x.kind.name.startswith("RECV")
                           and x in {receiver_of(s) for s in sent}]  # fmt: skip
                    assert [receiver_of(s) for s in sent] == got, (name, world, a, b)
