"""Recompute, activation offload and weight offload at run time: exact gradients, measured bytes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.gradcheck import (
    assert_same_gradients,
    assert_same_loss,
    batch_for,
    mlp,
    reference,
    token_loss,
    token_model,
)
from zeropipe import build_schedule
from zeropipe.base.device import Copier, peak_allocated_bytes
from zeropipe.base.storage import (
    as_bytes,
    distinct_bytes,
    movable,
    same_storage,
    storage_key,
    storage_nbytes,
    view_bytes,
)
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes.fit import checkpoint, offload, offload_weights
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.runtime.memory.manager import is_recomputing
from zeropipe.runtime.memory.offload import SavedActivations
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zbv"]


def _with(schedule: Schedule, mode: str) -> Schedule:
    """``mode``: R (recompute everything), O (offload everything), RO (both), or mixed."""
    if mode == "mixed":  # per stage and microbatch: all but the last microbatch recomputed
        last = schedule.microbatches - 1
        schedule = checkpoint(schedule, lambda s, i: i < last)
        return offload(schedule, lambda s, i: i == last)
    if "R" in mode:
        schedule = checkpoint(schedule)
    if "O" in mode:
        schedule = offload(schedule)
    return schedule


@pytest.mark.parametrize("mode", ["R", "O", "RO", "mixed"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_gradients_equal_the_reference_with_recompute_and_offload(name: str, mode: str) -> None:
    models: list[tuple[Callable[[], nn.Sequential], Callable[[Tensor, Tensor], Tensor]]] = [
        (lambda: mlp(dropout=0.3), F.mse_loss),
        (lambda: token_model(dropout=0.2), token_loss),
    ]
    for build, loss_fn in models:
        model = build()
        x, y = batch_for(model, batch=8)
        ref_loss, ref = reference(model, x, y, loss_fn, 4, seed=5)
        schedule = _with(generate(name, 2, 4), mode)
        pipe = Pipeline(model, schedule, loss_fn=loss_fn, options=RuntimeOptions(seed=5))
        assert_same_loss(pipe.step(x, y), ref_loss)
        assert_same_gradients(model.named_parameters(), ref)
        report = pipe.memory.report
        pairs = schedule.num_stages * schedule.microbatches
        recomputed = sum(1 for acts in schedule.actions for a in acts if a.kind is Kind.R)
        assert report.recomputations == recomputed and (mode == "O" or 0 < recomputed <= pairs)
        if "O" in mode and mode != "RO":
            assert max(report.host) > 0  # bytes really left for host memory


class _Probe(nn.Module):
    """Identity that counts its forwards and records a random draw per (microbatch, call)."""

    def __init__(self, log: list[tuple[bool, float]]) -> None:
        super().__init__()
        self.log = log
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        self.log.append((is_recomputing(), torch.rand(()).item()))
        return F.dropout(self.lin(x), 0.5, self.training)


@pytest.mark.parametrize("name", ["zb-h1", "zbv"])
def test_one_recompute_per_checkpointed_pair_serves_both_i_and_w(name: str) -> None:
    ranks, m = 2, 3
    stages_n = ranks * (2 if name == "zbv" else 1)
    logs: list[list[tuple[bool, float]]] = [[] for _ in range(stages_n)]
    torch.manual_seed(0)
    stages = [_Probe(logs[s]).double() for s in range(stages_n)]
    schedule = checkpoint(generate(name, ranks, m))
    pipe = Pipeline(stages, schedule, loss_fn=F.mse_loss)
    x = torch.randn(6, 4, dtype=torch.float64)
    pipe.step(x, torch.randn(6, 4, dtype=torch.float64))
    for s, log in enumerate(logs):
        first = [v for rec, v in log if not rec]
        again = [v for rec, v in log if rec]
        assert len(first) == m and len(again) == m, f"stage {s}: {len(first)} F, {len(again)} R"
        # R restores the randomness: per microbatch the same draws (schedule order may differ).
        assert sorted(first) == sorted(again)
    assert pipe.memory.report.recomputations == stages_n * m
    # W ran from what R recorded (the stash held the linears' inputs and gradients).
    assert all(pipe.memory.act_w[s] > 0 for s in range(stages_n))
    assert not is_recomputing()


def test_saved_bytes_are_what_the_graph_keeps_beyond_weights_and_boundaries() -> None:
    # Linear saves its input (the stage input: a boundary) and weight (a parameter);
    # tanh saves its output, which the second linear saves too (one storage).
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double()
    head = nn.Sequential(nn.Linear(8, 8)).double()
    pipe = Pipeline([stage, head], generate("gpipe", 2, 2), loss_fn=F.mse_loss)
    x, y = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    pipe.step(x, y)
    per_mb = 3 * 16 * 8  # rows x width x float64
    assert pipe.memory.act[0] == per_mb
    assert pipe.peak_saved_bytes[0] == 2 * per_mb  # gpipe: both microbatches at once
    # The head saves its input (boundary) and weight only; mse_loss saves the output
    # (3 x 8 float64) and the caller's target (not counted).
    assert pipe.memory.act[1] == 3 * 8 * 8


def _hooked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record which (stage, microbatch) each tensor through SavedActivations' pack hook came from."""
    calls: list[str] = []
    pack = SavedActivations._pack

    def counting(self: SavedActivations, t: Tensor) -> object:
        calls.append(self.where)
        return pack(self, t)

    monkeypatch.setattr(SavedActivations, "_pack", counting)
    return calls


def test_saved_bytes_are_counted_once_per_input_shape_unless_always(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _hooked(monkeypatch)
    model = mlp(layers=4)
    batches = [batch_for(model, batch=b) for b in (8, 8, 12, 8)]
    peaks: dict[str, list[tuple[int, ...]]] = {}
    hooked: dict[str, list[int]] = {}
    for mode in ("once", "always"):
        pipe = Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=F.mse_loss, options=RuntimeOptions(count_saved=mode))  # fmt: skip
        peaks[mode], hooked[mode] = [], []
        for x, y in batches:
            calls.clear()
            pipe.step(x, y)
            peaks[mode].append(tuple(pipe.peak_saved_bytes))
            hooked[mode].append(len(calls))
    # The same counts either way, step after step; a new microbatch shape counts anew.
    assert peaks["once"] == peaks["always"]
    assert peaks["once"][0] == peaks["once"][1] == peaks["once"][3] < peaks["once"][2]
    # ... but "once" hooks only the first forward of each shape.
    assert hooked["always"][0] == hooked["always"][1] == hooked["always"][3] > 0
    assert hooked["once"][0] == hooked["always"][0] // 4  # one microbatch per stage
    assert hooked["once"][1] == hooked["once"][3] == 0 < hooked["once"][2]


def test_offloaded_stages_are_hooked_on_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _hooked(monkeypatch)
    model = mlp(layers=4)
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
    pipe = Pipeline(model, offload(generate("1f1b", 2, 4), lambda s, i: s == 0),
                    loss_fn=F.mse_loss)  # fmt: skip
    hooked: list[set[str]] = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        calls.clear()
        assert_same_loss(pipe.step(x, y), ref_loss)
        assert_same_gradients(model.named_parameters(), ref)
        assert max(pipe.memory.report.host) > 0
        hooked.append(set(calls))
    offloaded = {f"stage 0 microbatch {i}" for i in range(4)}
    assert hooked == [offloaded | {"stage 1 microbatch 0"}, offloaded]
    # Weight offload too: saved views of a parameter must follow it to the host.
    pipe = Pipeline(model, offload_weights(generate("looped-bfs", 1, 2, chunks=2)),
                    loss_fn=F.mse_loss)  # fmt: skip
    for _ in range(2):
        calls.clear()
        pipe.step(x, y)
    assert set(calls) == {f"stage {s} microbatch {i}" for s in range(2) for i in range(2)}
    with pytest.raises(PipelineError, match="count_saved"):
        RuntimeOptions(count_saved="never")  # type: ignore[arg-type]


CALIBRATE = {"gpipe": "gpipe", "1f1b": "1f1b", "zbv": "zbv"}


@pytest.mark.parametrize("name", sorted(CALIBRATE))
def test_measured_peak_is_the_simulated_peak(name: str) -> None:
    model = token_model(dropout=0.1)
    x, y = batch_for(model, batch=8)
    base = generate(name, 2, 4)
    calibration = Pipeline(model, base, loss_fn=token_loss)
    calibration.step(x, y)
    # Per stage bytes, from the plain schedule only.
    costs = calibration.measured_costs()
    for mode in ("none", "R", "O", "RO", "mixed"):
        schedule = base if mode == "none" else _with(base, mode)
        pipe = Pipeline(model, schedule, loss_fn=token_loss)
        pipe.step(x, y)
        predicted = simulate(pipe.schedule, costs).peak_memory
        for rank, (got, want) in enumerate(zip(pipe.peak_saved_bytes, predicted, strict=True)):
            assert abs(got - want) <= 0.10 * want, (name, mode, rank, got, want)
    # The timeline reports activations plus resident weights, as a weights-aware model predicts.
    with_weights = simulate(
        pipe.schedule,
        calibration.measured_costs(weights=True),
    )
    assert pipe.timeline().peak_memory == pytest.approx(with_weights.peak_memory, rel=0.10)


def _split(schedule: Schedule) -> Schedule:
    """B -> I W in place (a one-rank split-backward variant of any schedule)."""
    out = []
    for acts in schedule.actions:
        lst: list[Action] = []
        for a in acts:
            if a.kind is Kind.B:
                assert a.microbatch is not None
                lst += [
                    Action(Kind.I, a.stage, a.microbatch),
                    Action(Kind.W, a.stage, a.microbatch),
                ]
            else:
                lst.append(a)
        out.append(lst)
    return schedule.replace_actions(out)


WEIGHT_CASES: dict[str, Callable[[Schedule], Schedule]] = {
    "plain": lambda s: s,
    "split+recompute+offload": lambda s: checkpoint(
        offload(_split(s), lambda st, i: i % 2 == 0), lambda st, i: i % 2 == 1
    ),
}


@pytest.mark.parametrize("case", sorted(WEIGHT_CASES))
def test_weight_offload_on_one_rank_is_exact_and_keeps_two_stages_resident(case: str) -> None:
    model = mlp(layers=8, dropout=0.3)
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
    # fairscale's OffloadModel order: every microbatch through one stage, then the next.
    schedule = offload_weights(WEIGHT_CASES[case](generate("looped-bfs", 1, 4, chunks=4)))
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
    # Between steps every parameter is back in its host home (where the optimizer steps it).
    assert storages == [p.untyped_storage().data_ptr() for p in model.parameters()]
    # Four equal stages, at most two resident: the one computing and the one prefetched.
    stage_bytes = sum(p.numel() * 8 for p in pipe.stages[0].parameters())
    assert pipe.memory.report.weights == (2 * stage_bytes,)
    predicted = simulate(pipe.schedule, pipe.measured_costs(weights=True)).peak_memory
    assert pipe.timeline().peak_memory == pytest.approx(predicted, rel=0.10)
    # A second step accumulates onto the offloaded gradients (seeds differ by step).
    _, ref2 = reference(model, x, y, F.mse_loss, 4, step=1)
    pipe.step(x, y)
    assert_same_gradients(model.named_parameters(), {k: ref[k] + ref2[k] for k in ref})
    model.eval()  # no dropout: the forward-only schedule keeps the weight copies
    with torch.no_grad():
        expected = model(x)
    out = pipe.eval_step(x)
    assert out is not None and (out - expected).abs().max().item() <= 1e-12


def test_weight_offload_of_a_stage_with_tied_weights_is_refused() -> None:
    model = token_model()  # embedding tied to the head: stages 0 and 1 share a parameter
    schedule = offload_weights(generate("looped-bfs", 1, 2, chunks=2), [0])
    with pytest.raises(PipelineError, match="tied"):
        Pipeline(model, schedule, loss_fn=token_loss)


def test_copier_on_cpu_makes_real_copies_and_saved_activations_round_trip() -> None:
    copier = Copier(torch.device("cpu"))
    assert not copier.asynchronous and copier.stream is None
    src = torch.arange(6.0)
    out = copier.ready(copier.to_host(src))
    assert torch.equal(out, src) and out.untyped_storage().data_ptr() != src.data_ptr()
    assert peak_allocated_bytes(torch.device("cpu")) is None

    saved = SavedActivations("stage 0 microbatch 0", copier, frozenset(), {})
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    with saved.hooks():
        h = torch.tanh(x)  # saves its output
        loss = (h[:, 1:] * 2).sum()
    assert saved.seal([x]) == h.numel() * 8
    saved.offload()
    assert saved.nbytes == 0 and saved.host_nbytes == h.numel() * 8
    del h
    with pytest.raises(PipelineError, match="RELOAD them before the backward"):
        loss.backward(retain_graph=True)
    saved.reload()
    assert saved.nbytes == 4 * 3 * 8 and saved.host_nbytes == 0
    loss.backward()
    expected = torch.zeros(4, 3, dtype=torch.float64)
    expected[:, 1:] = 2 * (1 - torch.tanh(x.detach()[:, 1:]) ** 2)
    assert x.grad is not None and torch.allclose(x.grad, expected, rtol=0, atol=1e-14)


def test_distinct_bytes_counts_each_storage_once_less_the_excluded() -> None:
    base = torch.zeros(10, 4)  # 160 bytes
    other = torch.zeros(3, dtype=torch.float64)  # 24 bytes
    views = [base, base[2:], base.t(), other]
    assert distinct_bytes(views) == 160 + 24
    assert distinct_bytes(views, exclude={storage_key(base[5])}) == 24
    # No storage of their own: a meta tensor and a sparse one count nothing.
    assert distinct_bytes([other, torch.empty(1000, device="meta"), base.to_sparse()]) == 24


def test_storage_bytes_round_trip_through_a_view_of_any_geometry() -> None:
    base = torch.arange(12, dtype=torch.float64)
    view = base[2:].view(2, 5).t()  # offset, transposed: not the storage's own layout
    assert same_storage(base, view) and not same_storage(base, base.clone())
    assert storage_nbytes(view) == 12 * 8
    raw = as_bytes(view)
    assert raw.dtype is torch.uint8 and raw.numel() == 12 * 8 and same_storage(raw, base)
    again = view_bytes(raw, view.dtype, view.storage_offset(), view.shape, view.stride())
    assert torch.equal(again, view) and same_storage(again, base)
    # Only plain dense tensors can be rebuilt from their bytes.
    lazy_conj = torch.ones(2, dtype=torch.complex128).conj()  # a flag, not conjugated bytes
    assert movable(view) and not movable(base.to_sparse()) and not movable(lazy_conj)
