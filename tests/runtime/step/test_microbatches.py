"""Microbatches of different lengths in one step (``zeropipe.Microbatches``): exact against
the unsplit model on every generator, with recompute and offload, their saved bytes counted
per shape; every microbatch's shapes in the step's signature; mistakes refused by name.

The 2-rank cases (both point-to-point protocols) run in the shared launch of
``tests/runtime/dist_cases.py`` and are read by ``test_distributed_microbatches``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeropipe
from tests.gradcheck import mlp, no_crash
from tests.runtime.step import varlen_cases
from zeropipe.core.errors import PipelineError
from zeropipe.core.passes.fit import checkpoint, offload
from zeropipe.runtime.step.stage import Microbatches, given_signature, given_step
from zeropipe.runtime.transport.wire import describe_batch

TOL = 1e-10


# The generators whose schedules these cases run (auto is searched, not generated: the cost
# model's tests price it).
NAMES = (
    "gpipe",
    "1f1b",
    "zb-h1",
    "zb-h2",
    "interleaved-1f1b",
    "interleaved-zb",
    "looped-bfs",
    "zbv",
    "dualpipev",
    "dualpipe",
)


def _schedules() -> list[tuple[str, zeropipe.Schedule]]:
    return [
        (name, zeropipe.build_schedule(name, ranks=2, microbatches=varlen_cases.M))
        for name in NAMES
    ]


@pytest.mark.parametrize("model", sorted(varlen_cases.MODELS))
def test_every_generator_gives_the_unsplit_models_loss_and_gradients(model: str) -> None:
    checked = []
    for name, schedule in _schedules():
        worst = varlen_cases.errors(model, schedule)
        assert worst["loss"] <= TOL and worst["grad"] <= TOL, (name, worst)
        assert worst["checked"] > 0
        checked.append(name)
    assert checked == list(NAMES)


@pytest.mark.parametrize("rewrite", [checkpoint, offload])
def test_recompute_and_offload_stay_exact(rewrite: object) -> None:
    assert callable(rewrite)
    schedule = rewrite(zeropipe.generate("1f1b", ranks=2, microbatches=varlen_cases.M))
    for model in varlen_cases.MODELS:
        worst = varlen_cases.errors(model, schedule)
        assert worst["loss"] <= TOL and worst["grad"] <= TOL, (model, worst)


def test_saved_bytes_are_counted_per_microbatch_shape() -> None:
    # Counted once per (stage, input shapes), the peaks are those of counting every forward.
    peaks: dict[str, list[tuple[int, ...]]] = {}
    for count in ("once", "always"):
        model = mlp(layers=8)
        options = zeropipe.RuntimeOptions(count_saved=count)
        schedule = zeropipe.build_schedule("gpipe", ranks=2, microbatches=varlen_cases.M)
        pipe = zeropipe.Pipeline(model, schedule, nn.MSELoss(), options=options)
        peaks[count] = []
        for step in varlen_cases.STEPS:
            pipe.step(varlen_cases.MODELS["mlp"][1](step))
            peaks[count].append(tuple(pipe.peak_saved_bytes))
    assert peaks["once"] == peaks["always"], peaks
    # gpipe holds every microbatch at once: the peak is the sum over their own sizes, and
    # the two steps' shapes (28 and 37 rows x positions on rank 0) give different peaks
    assert peaks["once"][0] == peaks["once"][2] != peaks["once"][1]


def test_eval_step_returns_one_output_per_microbatch_and_the_loss() -> None:
    model = mlp(layers=8)
    schedule = zeropipe.build_schedule("1f1b", ranks=2, microbatches=varlen_cases.M)
    pipe = zeropipe.Pipeline(model, schedule, nn.MSELoss())
    batches = varlen_cases.MODELS["mlp"][1](1)
    outputs = pipe.eval_step(Microbatches(inputs=batches.inputs))
    assert isinstance(outputs, list) and len(outputs) == varlen_cases.M
    with torch.no_grad():
        for x, out in zip(batches.inputs, outputs, strict=True):
            assert isinstance(out, torch.Tensor)
            assert (out - model(x)).abs().max().item() <= TOL
        loss = pipe.eval_step(batches)
    want = varlen_cases.reference(model, batches, varlen_cases.MODELS["mlp"][2])[0]
    assert isinstance(loss, torch.Tensor) and abs(loss.item() - want) <= TOL


def test_the_signature_covers_every_microbatch() -> None:
    batches = varlen_cases.MODELS["gpt"][1](0)
    names, micro, sizes, targets = given_step(batches, varlen_cases.M, None)
    assert names is None and sizes == [2, 1, 3, 1]
    signature = given_signature(micro, targets, names)
    # a middle microbatch of another length is another signature (first and last alike)
    middle = list(micro)
    middle[1] = (torch.zeros(1, 4, dtype=torch.int64),)
    assert given_signature(middle, targets, names) != signature
    text = describe_batch(signature)
    assert text.startswith("4 microbatches: inputs int64[2, 5] to int64[1, 7], targets"), text
    named = Microbatches(inputs=[{"input_ids": x} for x in batches.inputs])
    names, micro, _, _ = given_step(named, varlen_cases.M, None)
    text = describe_batch(given_signature(micro, None, names))
    assert text.startswith("4 microbatches: inputs (input_ids) int64[2, 5]"), text


def test_mistakes_are_refused_by_name() -> None:
    model = mlp(layers=4)
    two = zeropipe.build_schedule("1f1b", ranks=2, microbatches=2)
    pipe = zeropipe.Pipeline(model, two, nn.MSELoss())
    x = [torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(1, 5, 8, dtype=torch.float64)]
    y = [torch.randn_like(t) for t in x]
    with pytest.raises(PipelineError, match=r"holds 3 microbatches but the pipeline runs 2"):
        pipe.step(Microbatches(inputs=[*x, x[0]], targets=[*y, y[0]]))
    with pytest.raises(PipelineError, match=r"2 inputs but 1 targets"):
        Microbatches(inputs=x, targets=y[:1])
    with pytest.raises(PipelineError, match=r"one batch per microbatch \(a list\), got Tensor"):
        Microbatches(inputs=x[0])
    with pytest.raises(PipelineError, match=r"targets are given inside it"):
        pipe.step(Microbatches(inputs=x, targets=y), y[0])
    with pytest.raises(PipelineError, match=r"a training step needs targets"):
        pipe.step(Microbatches(inputs=x))
    with pytest.raises(PipelineError, match=r"microbatch 1's target must be .* \(1\), got"):
        pipe.step(Microbatches(inputs=x, targets=[y[0], y[0]]))
    with pytest.raises(PipelineError, match=r"microbatch 1's inputs are 2 tensor\(s\), but"):
        pipe.step(Microbatches(inputs=[x[0], (x[1], x[1])], targets=y))
    with pytest.raises(PipelineError, match=r"microbatch 1's inputs are a dict \(x\)"):
        pipe.step(Microbatches(inputs=[x[0], {"x": x[1]}], targets=y))
    # A mean weighted by rows cannot weight rows of different lengths exactly.
    rows = zeropipe.Pipeline(model, two, torch.nn.functional.mse_loss)
    with pytest.raises(PipelineError, match=r"targets differ beyond their rows"):
        rows.step(Microbatches(inputs=x, targets=y))
    # ... and is exact when they do not (rows of one length, different row counts).
    same = [torch.randn(3, 8, dtype=torch.float64), torch.randn(1, 8, dtype=torch.float64)]
    loss = rows.step(Microbatches(inputs=same, targets=[t + 1 for t in same]))
    with torch.no_grad():
        want = torch.nn.functional.mse_loss(model(torch.cat(same)), torch.cat(same) + 1)
    assert abs(loss.item() - want.item()) <= TOL


def test_distributed_microbatches() -> None:
    from tests.runtime import dist_cases

    results = dist_cases.main_results(2)
    for rank, out in enumerate(results):
        no_crash(out["microbatches"], f"rank {rank}'s microbatches of different lengths")
        assert len(out["microbatches"]) == 6
        for case, worst in out["microbatches"].items():
            assert worst["loss"] <= TOL and worst["grad"] <= TOL, (rank, case, worst)
            assert worst["checked"] > 0, (rank, case)
