"""What each rank runs in the distributed tests (spawned by zeropipe.launch, or by torchrun).

Spawning costs seconds, so one launch per world size (``main_results``, cached
for the test session) runs every case in turn inside the ranks and returns
losses, gradients and messages; the tests in test_distributed.py,
test_failures.py and test_step_agreement.py assert on them in the test process,
which also computes the reference gradients once.  A case that crashes inside a rank is returned as
its traceback, so one broken case does not hide the others.  The failure
cases run last: each poisons only its own pipeline (own store keys and tags).

Run as a module under torchrun it is the torchrun tests' script (``raise``: rank 1
raises inside a step, and the exception ends the process)::

    python -m torch.distributed.run --nproc-per-node 2 ... -m tests.runtime.dist_cases [raise]
"""

from __future__ import annotations

import functools
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tests.gradcheck import (
    assert_same_gradients,
    batch_for,
    mlp,
    reference,
    token_loss,
    token_model,
)
from tests.runtime.transport import agreement_cases, failure_cases
from zeropipe import build_schedule
from zeropipe.base import _compat
from zeropipe.core.costs import CostModel
from zeropipe.core.errors import PipelineError, ScheduleError
from zeropipe.core.ir import Action, Kind
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.planning.plan import auto_plan
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions
from zeropipe.runtime.transport.tagged import DistributedTransport

TIMEOUT = 30.0  # seconds a rank waits for a peer in these cases
OPTIONS = RuntimeOptions(timeout=TIMEOUT)


def seeded(seed: int) -> RuntimeOptions:
    return replace(OPTIONS, seed=seed)


MODELS: dict[str, tuple[Callable[[], nn.Sequential], Callable[..., Tensor]]] = {
    "mlp-dropout": (lambda: mlp(dropout=0.3), F.mse_loss),
    "tokens-tied": (lambda: token_model(dropout=0.2), token_loss),
}


def guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return {"crashed": traceback.format_exc()}


def supported(name: str, p: int, m: int) -> bool:
    try:
        generate(name, p, m)
    except ScheduleError as err:
        if err.rule != "unsupported":
            raise
        return False
    return True


def grid(world: int) -> list[tuple[str, str, int]]:
    """Every (generator, model, microbatches) the gradient test covers for ``world`` ranks."""
    return [
        (name, model, m)
        for name in sorted(GENERATORS)
        for model in sorted(MODELS)
        for m in sorted({1, world, 2 * world, 2 * world + 1})  # 2p: dualpipe takes even m only
        if supported(name, world, m)
    ]


# -- gradient equality --------------------------------------------------------------
def _grads_by_stage(stages: list[_Mix]) -> dict[str, Tensor]:
    return {
        f"{s}.{n}": p.grad.clone()
        for s, m in enumerate(stages)
        for n, p in m.named_parameters()
        if p.grad is not None
    }


def _owned_grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def steps_for(world: int, m: int) -> int:
    """Steps a gradient case runs: the first learns the boundary shapes (headers); the
    second, run where most transfers are (m = 2p+1), sends payload only."""
    return 2 if m == 2 * world + 1 else 1


def _grad_case(rank: int, world: int, name: str, model_name: str, m: int) -> dict[str, Any]:
    """Each step's loss and this rank's gradients (the test process computes the
    reference once per (model, m, step) instead of every rank)."""
    build, loss_fn = MODELS[model_name]
    model = build()
    x, y = batch_for(model, batch=2 * m + 1)
    # auto searches under given costs (each rank alike; profiling is another module's test)
    schedule = (
        auto_plan(model, world, m, costs=CostModel.uniform(world)).schedule
        if name == "auto"
        else name
    )
    pipe = Pipeline(model, schedule, microbatches=m, loss_fn=loss_fn, options=seeded(3))
    steps = []
    for _ in range(steps_for(world, m)):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        steps.append({"loss": loss.item(), "grads": _owned_grads(model)})
    return {"steps": steps}


def _grad_cases(rank: int, world: int) -> dict[str, Any]:
    return {
        f"{name}/{model}/m={m}": guard(functools.partial(_grad_case, rank, world, name, model, m))
        for name, model, m in grid(world)
    }


GROUPED = ("zbv", "zb-h1", "interleaved-zb", "1f1b", "interleaved-1f1b")  # run with W in groups


def _grouped_weights(rank: int, world: int) -> dict[str, Any]:
    """W gathered in groups (run fused): the gradient case's model, m = 2p+1, two steps."""
    out = {}
    for name in GROUPED:
        if not supported(name, world, 2 * world + 1):
            continue
        for size in (2, 3):
            out[f"{name}/w{size}"] = guard(
                functools.partial(_grouped_case, name, size, 2 * world + 1, world)
            )
    return out


def _grouped_case(name: str, size: int, m: int, world: int) -> dict[str, Any]:
    build, loss_fn = MODELS["tokens-tied"]
    model = build()
    x, y = batch_for(model, batch=2 * m + 1)
    schedule = build_schedule(name, ranks=world, microbatches=m, group_w=size)
    pipe = Pipeline(model, schedule, loss_fn=loss_fn, options=seeded(3))
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        steps.append({"loss": loss.item(), "grads": _owned_grads(model)})
    return {"steps": steps, "fused": len(pipe.fused_weights)}


def _same_seed(rank: int, world: int) -> dict[str, Any]:
    model = mlp(dropout=0.5)
    x, y = batch_for(model, batch=9)
    pipe = Pipeline(model, "1f1b", microbatches=4, loss_fn=F.mse_loss, options=seeded(11))
    loss = pipe.step(x, y)
    return {"loss": loss.item(), "grads": _owned_grads(model)}


def _handovers(rank: int, world: int) -> dict[str, int]:
    """Hand-overs to a pool thread in one later step: one per receive, one per barrier round."""
    model = mlp()
    x, y = batch_for(model, batch=8)
    pipe = Pipeline(model, "1f1b", microbatches=4, loss_fn=F.mse_loss, options=OPTIONS)
    pipe.step(x, y)  # the first step also waits for each transfer's shape header
    pool = pipe.parts.transport._endpoint.pool  # type: ignore[attr-defined]
    count = 0
    submit = pool.submit

    def counted(job: Callable[[], None]) -> None:
        nonlocal count
        count += 1
        submit(job)

    pool.submit = counted
    endpoint = pipe.parts.transport._endpoint  # type: ignore[attr-defined]
    wait, landed_count = endpoint.wait, 0

    def waited(pending: Any, *, landing: int | None = None) -> None:
        nonlocal landed_count
        before = count
        wait(pending, landing=landing)
        landed_count += landing is not None and count == before  # not handed over

    endpoint.wait = waited
    pipe.step(x, y)
    receives = sum(a.kind in (Kind.RECV_F, Kind.RECV_B) for a in pipe.schedule.actions[rank])
    return {"handovers": count, "landed": landed_count, "receives": receives}


def _landing(rank: int, world: int) -> dict[str, Any]:
    """``_compat.landed`` on a receive buffer: not before its message, once it has come, and
    never when the message's last bytes are the mark itself (then waited on as usual)."""
    group, tag, seen = dist.group.WORLD, 999_983, []
    for ordinary in (True, False):
        payload = torch.arange(4, dtype=torch.float64)
        if not ordinary:  # the mark as the last 8 bytes: indistinguishable, so "not landed"
            payload[-1:].view(torch.uint64).fill_(_compat._LANDING_MARK)
        buf = torch.empty(4, dtype=torch.float64)
        address = _compat.mark_landing(buf) if rank == 1 else None
        work = _compat.p2p_recv(group, buf, 0, tag) if rank == 1 else None
        before = address is not None and _compat.landed(address)  # rank 0 sends after this
        dist.barrier()
        if rank == 0:
            _compat.p2p_send(group, payload, 1, tag).wait()
        dist.barrier()
        if rank == 1:
            assert address is not None and work is not None
            if ordinary:  # sent: the I/O thread reads it in soon (looked for, bounded)
                deadline = time.monotonic() + TIMEOUT
                while not _compat.landed(address) and time.monotonic() < deadline:
                    time.sleep(0.001)
                after = _compat.landed(address)
                work.wait()
            else:  # read in whole, and still its last bytes are the mark's
                work.wait()
                after = _compat.landed(address)
            seen.append({"before": before, "landed": after, "equal": torch.equal(buf, payload)})
    small = _compat.mark_landing(torch.empty(1, dtype=torch.float32))
    return {"seen": seen, "small": small}


def same_seed_local(ranks: int) -> dict[str, Any]:
    """The same run as ``_same_seed`` on the local executor (in the test process)."""
    model = mlp(dropout=0.5)
    x, y = batch_for(model, batch=9)
    pipe = Pipeline(
        model,
        build_schedule("1f1b", ranks=ranks, microbatches=4),
        loss_fn=F.mse_loss,
        options=RuntimeOptions(seed=11),
    )
    loss = pipe.step(x, y)
    return {"loss": loss.item(), "grads": _owned_grads(model)}


def _shared_accumulation(rank: int, world: int) -> dict[str, Any]:
    """Two steps without zero_grad: tied gradients must accumulate like two backward calls.

    Under 1f1b every rank at the ends owns the tied weight; under zbv both tied
    stages sit on rank 0 and the other ranks own none of it.
    """
    diffs = {}
    for name in ("1f1b", "zbv"):
        model = token_model()
        x, y = batch_for(model, batch=8)
        ref = reference(model, x, y, token_loss, 4)[1]
        pipe = Pipeline(model, name, microbatches=4, loss_fn=token_loss, options=OPTIONS)
        pipe.step(x, y)
        pipe.step(x, y)
        if 0 in pipe.stages:
            got = model.get_parameter("0.weight").grad
            assert got is not None
            diffs[name] = (got - 2 * ref["0.weight"]).abs().max().item()
    return {"diff": max(diffs.values(), default=0.0), "checked": sorted(diffs)}


def _auto_profiled(rank: int, world: int) -> dict[str, Any]:
    """auto_plan without costs: every rank profiles, rank 0's plan is used."""
    model = mlp()
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 2)
    plan = auto_plan(model, world, 2, sample=(x, y), loss_fn=F.mse_loss)
    pipe = Pipeline(model, plan.schedule, loss_fn=F.mse_loss, balance=plan.balance, options=OPTIONS)
    loss = pipe.step(x, y)
    grads = _owned_grads(model)
    return {
        "loss_diff": abs(loss.item() - ref_loss.item()),
        "grad_diff": max((g - ref[n]).abs().max().item() for n, g in grads.items()),
        "schedule": pipe.schedule.to_text(),
    }


def _profiler_names(rank: int, world: int) -> dict[str, Any]:
    """One profiled zbv step: the PP: names this rank's trace holds, and its schedule's actions."""
    from torch.profiler import ProfilerActivity, profile

    model = mlp()
    pipe = Pipeline(model, "zbv", microbatches=4, loss_fn=F.mse_loss, options=OPTIONS)
    x, y = batch_for(model, batch=8)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pipe.step(x, y)
    names = [e.name for e in prof.events() if e.name.startswith("PP:")]
    return {
        "names": sorted(names),
        "actions": sorted(f"PP:{a}" for a in pipe.schedule.actions[pipe.rank]),
    }


def _eval_and_rebatch(rank: int, world: int) -> dict[str, Any]:
    """eval_step, and training steps whose batch size changes (boundary shapes re-learnt)."""
    model = mlp()
    pipe = Pipeline(model, "1f1b", microbatches=4, loss_fn=F.mse_loss, options=OPTIONS)
    x, y = batch_for(model, batch=8)
    with torch.no_grad():
        plain = model(x)
    out = pipe.eval_step(x)
    eval_loss = pipe.eval_step(x, y)
    result: dict[str, Any] = {
        "eval_output": None if out is None else (out - plain).abs().max().item(),
        "eval_loss": None if eval_loss is None else eval_loss.item(),
        "plain_loss": F.mse_loss(plain, y).item(),
        "steps": [],
    }
    for batch in (8, 11, 8):
        x, y = batch_for(model, batch=batch, seed=batch)
        ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        worst = assert_same_gradients(model.named_parameters(), ref, only_owned=True)
        result["steps"].append((batch, abs(loss.item() - ref_loss.item()), worst))
    return result


# -- tuples with integer tensors across ranks ---------------------------------------
class _Mix(nn.Module):
    """(hidden, token ids) -> (hidden', same ids): integer tensors cross every boundary."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.lin, self.emb, self.last = nn.Linear(4, 4), nn.Embedding(7, 4), last

    def forward(self, h: Tensor, ids: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        out = torch.tanh(self.lin(h)) + self.emb(ids)
        return out if self.last else (out, ids)


def _tuple_case(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(5)
    stages = [_Mix(last=s == world - 1).double() for s in range(world)]
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, 4, dtype=torch.float64, generator=g)
    ids = torch.randint(0, 7, (6,), generator=g)
    y = torch.randn(6, 4, dtype=torch.float64, generator=g)
    value: Any = (x, ids)
    for st in stages:
        value = st(*value)
    F.mse_loss(value, y).backward()
    ref = _grads_by_stage(stages)
    for st in stages:
        st.zero_grad(set_to_none=True)
    pipe = Pipeline(stages, "1f1b", microbatches=3, loss_fn=F.mse_loss, options=OPTIONS)
    loss = pipe.step((x, ids), y)
    got = [(f"{s}.{n}", p) for s, m in enumerate(stages) for n, p in m.named_parameters()]
    return {
        "worst": assert_same_gradients(got, ref, only_owned=True),
        "loss": loss.item(),
        "ref_loss": F.mse_loss(value, y).item(),
    }


# -- the transport on its own ---------------------------------------------------------
def _transport_case(rank: int, world: int) -> dict[str, Any]:
    """Ints, bools and tuples cross; reset re-learns; a changed shape fails on the sender."""
    t = DistributedTransport(lower(generate("1f1b", world, 1)), rank, timeout=TIMEOUT)
    send, recv = Action(Kind.SEND_F, 0, 0), Action(Kind.RECV_F, 1, 0)

    def payload(rows: int, step: int) -> tuple[Tensor, ...]:
        return (
            torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + step,
            torch.arange(rows, dtype=torch.int64) * 1000 + step,
            torch.tensor([True, False, step % 2 == 0]),
        )

    ok = []
    for step, rows in enumerate([2, 2, 5]):
        if step == 2:
            t.reset()
        if rank == 0:
            t.send(send, payload(rows, step))
        elif rank == 1:
            t.post_recv(recv)
            got = t.wait_recv(recv)
            want = payload(rows, step)
            ok.append(
                len(got) == 3
                and all(
                    a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True)
                )
            )
        t.finish_step()
    out: dict[str, Any] = {"received_ok": ok, "device_error": None}
    if rank == 0:  # refused before anything is posted
        other = DistributedTransport(lower(generate("1f1b", world, 1)), rank, timeout=TIMEOUT)
        try:
            other.send(send, (torch.empty(2, 3, device="meta"),))
        except PipelineError as err:
            out["device_error"] = str(err)
    else:
        DistributedTransport(lower(generate("1f1b", world, 1)), rank, timeout=TIMEOUT)
    start = time.monotonic()
    try:
        if rank == 0:
            try:
                t.send(send, payload(4, 3))  # learnt: 5 rows
            except PipelineError as err:
                t.fail(err)
                raise
        elif rank == 1:
            t.post_recv(recv)
            t.wait_recv(recv)
        t.finish_step()
        out["error"] = None
    except PipelineError as err:
        out["error"] = str(err)
    out["seconds"] = time.monotonic() - start
    return out


def _dualpipe_outputs(rank: int, world: int) -> str:
    """dualpipe's eval without a target: its outputs end on two ranks, which is refused
    on every rank alike, after a loss step ran."""
    model = mlp()
    x, y = batch_for(model, batch=8)
    pipe = Pipeline(model, "dualpipe", microbatches=2 * world, loss_fn=F.mse_loss, options=OPTIONS)
    pipe.step(x, y)
    try:
        pipe.eval_step(x)
    except PipelineError as err:
        return str(err)
    return "accepted"


def _fit_case(rank: int, world: int) -> list[str]:
    messages = []
    for make in (
        lambda: Pipeline(mlp(), generate("1f1b", 2 * world, 2), loss_fn=F.mse_loss),
        lambda: Pipeline(
            mlp(), build_schedule("1f1b", ranks=world + 1, microbatches=2), loss_fn=F.mse_loss
        ),
    ):
        try:
            make()
            messages.append("accepted")
        except PipelineError as err:
            messages.append(str(err))
    return messages


# -- launch entry points ---------------------------------------------------------------
LAUNCH_TIMEOUT = 240.0  # a whole healthy launch, startup included, on two busy cores


@functools.cache
def _launch_once(world: int) -> tuple[list[dict[str, Any]] | None, str | None]:
    from zeropipe.runtime.launch import launch

    try:
        return launch(main_cases, world, timeout=LAUNCH_TIMEOUT), None
    except PipelineError as err:
        return None, str(err)


def main_results(world: int) -> list[dict[str, Any]]:
    """``main_cases`` on ``world`` ranks, launched once per test session (per rank: its dict)."""
    results, error = _launch_once(world)
    if results is None:
        raise AssertionError(f"the {world}-rank launch failed:\n{error}")
    return results


def main_cases(rank: int, world: int) -> dict[str, Any]:
    """Everything that runs in the one healthy launch per world size; failures last."""
    start = time.monotonic()
    out: dict[str, Any] = {"fit": guard(lambda: _fit_case(rank, world))}
    out["store"] = guard(lambda: _store_check(rank, world))
    out["grads"] = _grad_cases(rank, world)
    out["same_seed"] = guard(lambda: _same_seed(rank, world))
    out["handovers"] = guard(lambda: _handovers(rank, world))
    out["landing"] = guard(lambda: _landing(rank, world))
    out["grouped"] = guard(lambda: _grouped_weights(rank, world))
    out["tuple"] = guard(lambda: _tuple_case(rank, world))
    out["eval_rebatch"] = guard(lambda: _eval_and_rebatch(rank, world))
    out["shared_accumulation"] = guard(lambda: _shared_accumulation(rank, world))
    out["auto_profiled"] = guard(lambda: _auto_profiled(rank, world))
    out["dualpipe_outputs"] = guard(lambda: _dualpipe_outputs(rank, world))
    if world == 2:
        from tests.runtime.step import test_batch_norm, test_loss  # their 2-rank cases

        out["batch_norm"] = guard(lambda: test_batch_norm.two_ranks(rank, world))
        # test_profiler_names reads the 2-rank launch's; starting a torch profiler costs each
        # process about a second (it imports torch._inductor), for nothing in the 4-rank one.
        out["profiler_names"] = guard(lambda: _profiler_names(rank, world))
        from tests.runtime.step import varlen_cases  # microbatches of different lengths

        out["microbatches"] = guard(lambda: varlen_cases.two_ranks(rank, world))
    out["healthy_seconds"] = time.monotonic() - start
    # Each failure poisons only its own pipeline (own store keys and tags).
    out["transport"] = guard(lambda: _transport_case(rank, world))
    out["mismatch"] = guard(lambda: failure_cases.mismatch_case(rank, world))
    out["forward_error"] = guard(lambda: failure_cases.forward_error_case(rank, world))
    out["stalled"] = guard(lambda: failure_cases.stalled_peer_case(rank, world))
    if world == 2:  # refused losses, then ranks out of step: one pipeline each
        out["loss"] = guard(lambda: test_loss.two_ranks(rank, world))
        out["agreement"] = guard(lambda: agreement_cases.two_ranks(rank, world))
    return out


def _store_check(rank: int, world: int) -> bool:
    """A key written to the launcher's store (as the launcher does) is seen by the ranks' polls."""
    from zeropipe.base import _compat

    raw = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False)
    if rank == 0:
        raw.set("zeropipe/probe", "x")
    dist.barrier()
    return bool(_compat.rendezvous_store().check(["zeropipe/probe"]))


# -- the torchrun script ---------------------------------------------------------------
def _torchrun_main() -> None:
    from zeropipe.runtime.launch import init_from_env

    torch.set_num_threads(1)
    rank, world = init_from_env(timeout=60)
    model = token_model(dropout=0.2)
    x, y = batch_for(model, batch=9)
    ref_loss, ref = reference(model, x, y, token_loss, 4, seed=5)
    pipe = Pipeline(model, "zb-h1", microbatches=4, loss_fn=token_loss,
                    options=RuntimeOptions(timeout=60, seed=5))  # fmt: skip
    loss = pipe.step(x, y)
    worst = assert_same_gradients(model.named_parameters(), ref, only_owned=True)
    assert abs(loss.item() - ref_loss.item()) <= 1e-10, (loss.item(), ref_loss.item())
    sys.stdout.write(
        f"rank {rank}/{world} ok worst={worst:.3g} loss={loss.item():.17g}\n"
    )  # one write: no interleaving mid-line
    sys.stdout.flush()
    dist.destroy_process_group()


def _torchrun_raise() -> None:
    """Rank 1 raises inside its second step; the exception is left to end the process."""
    from zeropipe.runtime.launch import init_from_env

    torch.set_num_threads(1)
    init_from_env(timeout=60)
    trap = failure_cases.Trap("raise")
    pipe = Pipeline([nn.Linear(4, 4), trap], "1f1b", microbatches=4, loss_fn=F.mse_loss,
                    options=RuntimeOptions(timeout=60))  # fmt: skip
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    trap.armed = dist.get_rank() == 1
    pipe.step(x, y)


if __name__ == "__main__":
    {"raise": _torchrun_raise}.get(sys.argv[1] if len(sys.argv) > 1 else "", _torchrun_main)()
