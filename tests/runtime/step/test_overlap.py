"""Overlapped pairs run at once (``RuntimeOptions(overlap=True)``): the same loss and
gradients, bitwise in float64, as the pairs run one half after the other; the two halves'
spans overlap in the measured timeline (and do not without overlap); an error in either
half is the PipelineError naming its action.

dualpipev on 2 ranks, in one process and in one 2-process gloo launch; an MLP and a
transformer-like stage (attention + MLP), both with dropout; with recompute and offload;
with the user's hooks; under bf16 autocast; and Hugging Face's Qwen3-MoE and
DeepSeek-V3 as ``zeropipe.split`` cuts them (router loss included).  A pipeline's pairs
run their backward halves on one worker, which ends with the pipeline; and
benchmarks/moe_overlap.py's hidden and coverable all-to-all time on hand-made events.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from tests.planning.benchmark_modules import load
from zeropipe import Pipeline, RuntimeOptions
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Schedule
from zeropipe.core.passes import fit
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.simulate import Event
from zeropipe.runtime.step.pairs import communicates_inside

WIDTH, SEQ = 16, 6


class Block(nn.Module):
    """A transformer block: attention and an MLP, each residual, with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 2, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * WIDTH, WIDTH)
        )

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


def mlp_model() -> nn.Sequential:
    layers = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.2), nn.GELU()) for _ in range(8)]
    return nn.Sequential(*layers).double()


def block_model() -> nn.Sequential:
    return nn.Sequential(*[Block() for _ in range(4)]).double()


MODELS: dict[str, tuple[Callable[[], nn.Sequential], tuple[int, ...]]] = {
    "mlp": (mlp_model, (24, WIDTH)),
    "transformer": (block_model, (12, SEQ, WIDTH)),
}
REWRITES: dict[str, Callable[[Schedule], Schedule]] = {
    "plain": lambda s: s,
    "recompute": lambda s: build_schedule(fit.checkpoint(s)),
    "offload": lambda s: build_schedule(fit.offload(s)),
}


def _schedule(rewrite: str, microbatches: int = 6) -> Schedule:
    return REWRITES[rewrite](build_schedule("dualpipev", ranks=2, microbatches=microbatches))


def _step_twice(
    model_name: str, rewrite: str, overlap: bool, **options: Any
) -> tuple[Tensor, list[Tensor], Pipeline]:
    """Two steps (the second reuses learnt shapes and counts); the loss and ``.grad`` after."""
    make, shape = MODELS[model_name]
    torch.manual_seed(0)
    model = make()
    x, y = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    pipe = Pipeline(
        model,
        _schedule(rewrite),
        loss_fn=F.mse_loss,
        options=RuntimeOptions(seed=7, overlap=overlap, **options),
    )
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        loss = pipe.step(x, y)
    assert loss is not None
    return loss, [p.grad.clone() for p in model.parameters() if p.grad is not None], pipe


def _concurrent_pairs(pipe: Pipeline) -> list[tuple[Event, Event]]:
    """The pairs the last step ran back to back in its walk, as their two events."""
    schedule, order = pipe.schedule, pipe.graph.order
    by_step = {(r, e.step): e for r, evs in enumerate(pipe.last_events) for e in evs}
    return [
        (by_step[(r, k)], by_step[(r, k + 1)])
        for (r, k), after in pairwise(order)
        if k in schedule.overlapped(r) and after == (r, k + 1)
    ]


def _assert_identical(a: tuple[Tensor, list[Tensor], Pipeline], b: tuple[Tensor, ...]) -> None:
    assert torch.equal(a[0], b[0]), (a[0].item(), b[0].item())
    assert len(a[1]) == len(b[1]) > 0
    for k, (g, h) in enumerate(zip(a[1], b[1], strict=True)):
        assert torch.equal(g, h), f"parameter {k}: max difference {(g - h).abs().max().item()}"


@pytest.mark.parametrize("rewrite", sorted(REWRITES))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_overlap_gives_the_gradients_of_pairs_in_sequence(model_name: str, rewrite: str) -> None:
    # Dropout draws per (step, microbatch, layer) on the forward's thread; a backward on the
    # other thread draws nothing, so the masks, the loss and every gradient are bitwise equal.
    on = _step_twice(model_name, rewrite, overlap=True)
    off = _step_twice(model_name, rewrite, overlap=False)
    _assert_identical(on, off[:2])
    assert len(_concurrent_pairs(on[2])) >= 4  # the pairs did run as pairs
    # The memory ledger counts a pair's forward, then its backward's release, either way.
    assert on[2].peak_saved_bytes == off[2].peak_saved_bytes
    assert on[2].timeline().peak_memory == off[2].timeline().peak_memory


@pytest.mark.filterwarnings("ignore:split backward. the weight of linear")
def test_overlap_with_hooks_and_autocast() -> None:
    def run(overlap: bool) -> tuple[Tensor, list[Tensor], list[str]]:
        torch.manual_seed(0)
        model = mlp_model().float()
        seen: list[str] = []
        model[1].register_forward_hook(lambda m, i, o: seen.append("forward"))
        model[5].register_full_backward_hook(lambda m, gi, go: seen.append("backward"))
        model[6][0].weight.register_hook(lambda g: g * 0.5)
        x, y = torch.randn(24, WIDTH), torch.randn(24, WIDTH)
        pipe = Pipeline(
            model,
            _schedule("plain"),
            loss_fn=F.mse_loss,
            options=RuntimeOptions(seed=1, overlap=overlap, autocast=torch.bfloat16),
        )
        loss = pipe.step(x, y)
        assert loss is not None
        return loss, [p.grad.clone() for p in model.parameters() if p.grad is not None], seen

    on, off = run(True), run(False)
    _assert_identical((on[0], on[1], None), (off[0], off[1]))  # type: ignore[arg-type]
    assert sorted(on[2]) == sorted(off[2]) == ["backward"] * 6 + ["forward"] * 6


class Checkpointed(nn.Module):
    """An MLP block with dropout recomputed in its backward by ``torch.utils.checkpoint``,
    flagged as Hugging Face flags its layers (``gradient_checkpointing``)."""

    gradient_checkpointing = True

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.Dropout(0.3), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(self.body, x, use_reentrant=False)
        return out


def test_a_backward_that_recomputes_with_dropout_runs_its_pairs_in_sequence() -> None:
    # Its recompute restores the global generator and draws from it, as the forward beside it
    # seeds and draws: at once, each would draw the other's numbers.
    def run(overlap: bool) -> tuple[Tensor, list[Tensor], Pipeline]:
        torch.manual_seed(0)
        model = nn.Sequential(*[Checkpointed() for _ in range(4)]).double()
        options = RuntimeOptions(seed=2, overlap=overlap)
        pipe = Pipeline(model, _schedule("plain"), loss_fn=F.mse_loss, options=options)
        x = torch.randn(24, WIDTH, dtype=torch.float64)
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            loss = pipe.step(x, x)
        assert loss is not None
        return loss, [p.grad.clone() for p in model.parameters() if p.grad is not None], pipe

    on = run(True)
    _assert_identical(on, run(False)[:2])
    for forward, backward in _concurrent_pairs(on[2]):
        assert forward.end <= backward.start


@pytest.mark.parametrize("sharded", [{0, 1, 2, 3}, {0, 3}, {0, 1}])
def test_pairs_of_two_stages_that_run_collectives_run_in_sequence(sharded: set[int]) -> None:
    # A DTensor parameter (tensor or expert parallelism) means collectives inside the stage,
    # whose order every rank of their group must share: two such halves at once would
    # interleave theirs as the threads' timing falls.  Here a parameter merely carries
    # DTensor's ``placements`` attribute: the rule reads no more than that.
    pipe, model = _slow_pipe(True)
    for s in sharded:
        layer = model[s]
        assert isinstance(layer, SlowLayer)
        layer.linear.weight.placements = ("Shard(0)",)  # type: ignore[attr-defined]
    pipe.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    pairs = _concurrent_pairs(pipe)
    assert len(pairs) >= 3
    for forward, backward in pairs:
        shared = min(forward.end, backward.end) - max(forward.start, backward.start)
        both = {forward.action.stage, backward.action.stage} <= sharded
        assert (shared <= 0) if both else (shared > 0), (forward, backward, shared)


def test_pairs_whose_collectives_are_split_by_direction_run_at_once() -> None:
    # A module whose forward issues its collectives on one group and its backward on
    # another (expert parallelism's all-to-alls) keeps each group's order on every rank
    # with its pair's halves at once: its DTensor parameters do not count.  A DTensor
    # parameter of another module of the same stage still does.
    pipe, model = _slow_pipe(True)
    for layer in model:
        assert isinstance(layer, SlowLayer)
        layer.linear.weight.placements = ("Shard(0)",)  # type: ignore[attr-defined]
        layer.linear.collectives_split_by_direction = True  # type: ignore[assignment]
    pipe.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    pairs = _concurrent_pairs(pipe)
    assert len(pairs) >= 3
    for forward, backward in pairs:
        assert min(forward.end, backward.end) - max(forward.start, backward.start) > 0
    assert all(communicates_inside(layer) is False for layer in model)
    tp = nn.Linear(2, 2)
    tp.weight.placements = ("Shard(0)",)  # type: ignore[attr-defined]
    assert communicates_inside(nn.Sequential(model[0], tp))


def _gloo_cases(rank: int, world: int) -> dict[str, Any]:
    """On each of 2 gloo ranks: per case, the loss and this rank's gradients; and the
    overlap of each pair's halves on the slow model."""
    out: dict[str, Any] = {}
    for model_name in sorted(MODELS):
        for p2p in ("tagged", "ordered"):
            for rewrite in ("plain", "recompute") if p2p == "tagged" else ("plain",):
                for overlap in (True, False):
                    loss, grads, _ = _step_twice(model_name, rewrite, overlap, p2p=p2p)
                    out[f"{model_name} {p2p} {rewrite} {overlap}"] = (loss, grads)
    pipe, _ = _slow_pipe(True)
    pipe.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    mine = {e.step: e for e in pipe.last_events[rank]}
    out["shared"] = [
        min(mine[k].end, mine[k + 1].end) - max(mine[k].start, mine[k + 1].start)
        for k in sorted(pipe.schedule.overlapped(rank))
    ]
    out["failure"] = _failing_backward_on_rank_0(rank)
    return out


def _failing_backward_on_rank_0(rank: int) -> tuple[str, str]:
    """Rank 0's first pair's backward raises (on the worker thread): (that backward, the
    error this rank ends its step with)."""
    pipe, model = _slow_pipe(True, layer=_Trap)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    pipe.step(x, y)
    k = min(pipe.schedule.overlapped(0))
    backward = pipe.schedule.actions[0][k + 1]
    assert backward.microbatch is not None
    for layer in model:
        assert isinstance(layer, _Trap)
        layer.calls = 0
    if rank == 0:
        trap = model[backward.stage]
        assert isinstance(trap, _Trap)
        trap.call, trap.where = backward.microbatch + 1, "B"
    try:
        pipe.step(x, y)
    except PipelineError as err:
        return str(backward), str(err)
    return str(backward), "no error"


def test_overlap_on_two_gloo_processes() -> None:
    from zeropipe.runtime.launch import launch

    results = launch(_gloo_cases, 2, timeout=120.0)
    for rank, out in enumerate(results):
        cases = sorted(
            {name.rsplit(" ", 1)[0] for name in out if name not in ("shared", "failure")}
        )
        assert len(cases) == 6, cases
        for case in cases:
            on, off = out[f"{case} True"], out[f"{case} False"]
            assert torch.equal(on[0], off[0]), (rank, case)
            assert len(on[1]) == len(off[1]) > 0, (rank, case)
            for g, h in zip(on[1], off[1], strict=True):
                assert torch.equal(g, h), (rank, case)
        # Every pair of the rank ran its halves at once (each half sleeps 6 ms).
        assert len(out["shared"]) >= 2 and all(t > 0 for t in out["shared"]), out["shared"]
    # A backward that raised on rank 0's worker thread ends rank 0's step naming it, and
    # rank 1's naming rank 0, instead of hanging.
    backward, error = results[0]["failure"]
    assert f"rank 0 failed in training step 1 at action {backward} " in error, error
    assert "backward trap" in error
    assert "rank 0" in results[1]["failure"][1], results[1]["failure"]


class _Slow(torch.autograd.Function):
    """Identity whose forward and backward each take ``seconds`` (a sleep frees the GIL, as
    torch's kernels do): two such halves at once take one ``seconds``, not two."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad.clone(), None


class SlowLayer(nn.Module):
    def __init__(self, seconds: float = 0.006) -> None:
        super().__init__()
        self.linear, self.seconds = nn.Linear(WIDTH, WIDTH), seconds

    def forward(self, x: Tensor) -> Tensor:
        return _Slow.apply(self.linear(x), self.seconds)


def _slow_pipe(
    overlap: bool, layer: Callable[[], nn.Module] = SlowLayer
) -> tuple[Pipeline, nn.Sequential]:
    torch.manual_seed(0)
    model = nn.Sequential(*[layer() for _ in range(4)])
    schedule = _schedule("plain", microbatches=4)
    options = RuntimeOptions(overlap=overlap)
    return Pipeline(model, schedule, loss_fn=F.mse_loss, options=options), model


@pytest.mark.parametrize("overlap", [True, False])
def test_the_measured_timeline_shows_a_pair_s_halves_at_the_same_time(overlap: bool) -> None:
    pipe, _ = _slow_pipe(overlap)
    pipe.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
    pairs = _concurrent_pairs(pipe)
    assert len(pairs) >= 3
    timeline = pipe.timeline()
    measured = {(e.action, e.start, e.end) for evs in timeline.events for e in evs}
    for forward, backward in pairs:
        assert (forward.action, forward.start, forward.end) in measured
        # [start, end) intervals: each half takes >= 6 ms; at once, they share some of it.
        shared = min(forward.end, backward.end) - max(forward.start, backward.start)
        if overlap:
            assert shared > 0, (forward, backward)
        else:
            assert shared <= 0, (forward, backward)


class _Threads(nn.Module):
    """A linear layer whose backward records the thread it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.threads: list[threading.Thread] = []

    def forward(self, x: Tensor) -> Tensor:
        out = self.linear(x)
        out.register_hook(lambda grad: self.threads.append(threading.current_thread()))
        return out


def test_a_pipeline_s_pairs_run_their_backwards_on_one_worker_that_ends_with_it() -> None:
    # One worker for all the pairs of all the steps a pipeline runs, so that what torch keeps
    # per thread (DTensor's sharding-propagation cache) stays warm; it ends with the pipeline
    # (here dropped with the thread that stepped it).
    seen: dict[str, Any] = {}

    def two_steps() -> None:
        pipe, model = _slow_pipe(True, layer=_Threads)
        for _ in range(2):
            pipe.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
        seen["pairs"] = len(_concurrent_pairs(pipe))
        seen["threads"] = {
            t for layer in model if isinstance(layer, _Threads) for t in layer.threads
        }

    caller = threading.Thread(target=two_steps, name="stepping")
    caller.start()
    caller.join()
    assert seen["pairs"] >= 3
    workers = seen["threads"] - {caller}
    assert caller in seen["threads"] and len(workers) == 1, seen["threads"]
    (worker,) = workers
    gc.collect()
    worker.join(timeout=10.0)
    assert not worker.is_alive()


class _Trap(nn.Module):
    """A layer whose ``call``-th forward this step raises (``where="F"``), or whose
    backward of that forward raises (``where="B"``); ``call`` None: never."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.call: int | None = None
        self.where = ""
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.call and self.where == "F":
            raise ValueError("forward trap")
        out = self.linear(x)
        if self.calls == self.call and self.where == "B":
            out.register_hook(_raise_in_backward)
        return out


def _raise_in_backward(grad: Tensor) -> Tensor:
    raise ValueError("backward trap")


@pytest.mark.parametrize("failing", ["F", "B", "FB"])
def test_an_error_in_either_half_names_its_action(failing: str) -> None:
    pipe, model = _slow_pipe(True, layer=_Trap)
    traps = [m for m in model if isinstance(m, _Trap)]
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    pipe.step(x, y)  # a healthy step first
    # A pair the walk runs at once (a local run's order may part some pairs' members).
    forward, backward = (e.action for e in _concurrent_pairs(pipe)[0])
    # Stage s is layer s; its forwards run microbatch 0, 1, ... in order.
    assert forward.microbatch is not None and backward.microbatch is not None
    for trap in traps:
        trap.calls = 0
    if "F" in failing:
        traps[forward.stage].call, traps[forward.stage].where = forward.microbatch + 1, "F"
    if "B" in failing:
        traps[backward.stage].call, traps[backward.stage].where = backward.microbatch + 1, "B"
    with pytest.raises(PipelineError) as caught:
        pipe.step(x, y)
    named = forward if "F" in failing else backward
    assert f"at action {named} " in str(caught.value), str(caught.value)
    assert ("forward trap" if "F" in failing else "backward trap") in str(caught.value)
    notes = getattr(caught.value, "__notes__", [])
    if sys.version_info >= (3, 11):
        assert any(f"overlapped {backward} failed too" in n for n in notes) == (failing == "FB")
    for trap in traps:  # disarmed, the pipeline steps again
        trap.call = None
    assert pipe.step(x, y) is not None


def test_overlap_must_be_a_bool() -> None:
    with pytest.raises(PipelineError, match="overlap must be True or False"):
        RuntimeOptions(overlap="yes")  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: the backward half runs on a worker thread on the forward's stream",
)
def test_overlap_on_a_gpu_gives_the_gradients_of_pairs_in_sequence() -> None:
    def run(overlap: bool) -> tuple[Tensor, list[Tensor]]:
        torch.manual_seed(0)
        model = block_model().cuda()
        x = torch.randn(12, SEQ, WIDTH, dtype=torch.float64, device="cuda")
        y = torch.randn(12, SEQ, WIDTH, dtype=torch.float64, device="cuda")
        options = RuntimeOptions(seed=7, overlap=overlap, device="cuda")
        pipe = Pipeline(model, _schedule("plain"), loss_fn=F.mse_loss, options=options)
        loss = pipe.step(x, y)
        assert loss is not None
        return loss.cpu(), [p.grad.cpu() for p in model.parameters() if p.grad is not None]

    on, off = run(True), run(False)
    assert torch.equal(on[0], off[0])
    for g, h in zip(on[1], off[1], strict=True):
        assert torch.equal(g, h)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_overlap_on_unmodified_hugging_face_moe_models(arch: str) -> None:
    # The models zeropipe.split cuts (tests/adapters/hf_moe_cases: float64, router loss on).
    pytest.importorskip("transformers")
    import zeropipe
    from tests.adapters import hf_cases
    from tests.adapters.hf_moe_cases import M, build, cut

    model = build(arch)
    ids, labels = hf_cases.batch(0, 8)
    out = {}
    for overlap in (True, False):
        schedule = build_schedule("dualpipev", ranks=2, microbatches=M)
        for p in model.parameters():
            p.grad = None
        pipe = Pipeline(
            cut(model, schedule.num_stages),
            schedule,
            loss_fn=zeropipe.causal_lm_loss,
            mesh="local",
            options=RuntimeOptions(overlap=overlap),
        )
        loss = pipe.step(ids, labels)
        assert loss is not None
        out[overlap] = (loss, [p.grad.clone() for p in model.parameters() if p.grad is not None])
        if overlap:
            assert _concurrent_pairs(pipe)
    _assert_identical((*out[True], None), out[False])  # type: ignore[arg-type]


def test_the_moe_benchmark_counts_hidden_and_coverable_all_to_all_time() -> None:
    # benchmarks/moe_overlap.py's measures on hand-made events.  At once: F [0, 10) on the
    # calling thread (1) with exchanges [1, 4) and [6, 8), B [0, 6) on the worker (2) with
    # [2, 5).  Hidden: F's [1, 2) and B's [4, 5), the other half running outside an
    # exchange; beside: F's [1, 4) and B's [2, 5), the other half running at all.
    bench = load("moe_overlap")
    f, b = Action.parse("0F0"), Action.parse("1B0")
    at_once = [Event(0, 0, f, 0.0, 10.0), Event(0, 1, b, 0.0, 6.0)]
    calls = [(1, 1.0, 4.0), (2, 2.0, 5.0), (1, 6.0, 8.0)]
    assert bench.hidden_time(at_once, [0], calls, caller=1) == (2.0, 6.0)
    # In sequence: F computes 5 and exchanges 5; B [10, 16) waits 1 for its gradient,
    # exchanges [12, 15) and computes 2.  At once, B's compute could cover 2 of F's
    # exchanges and F's compute all 3 of B's.
    in_turn = [Event(0, 0, f, 0.0, 10.0), Event(0, 1, b, 10.0, 16.0, wait=1.0)]
    calls = [(1, 1.0, 4.0), (1, 6.0, 8.0), (1, 12.0, 15.0)]
    assert bench.coverable_time(in_turn, [0], calls) == 5.0
    assert bench.hidden_time(in_turn, [0], calls, caller=1) == (0.0, 0.0)
