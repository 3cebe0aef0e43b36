"""Schedules written by torch.distributed.pipelining's generators run exactly, as imported.

torch's compute-only CSVs (GPipe's REDUCE_GRAD actions and DualPipeV's OVERLAP_F_B pairs
included) are read with ``Schedule.from_torch_csv`` and run by ``Pipeline`` in one process
(every rank played locally), float64: the loss and every gradient equal the plain model's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.nn.functional as F

from tests.core.schedules.test_torch_import import _MULTI, _torch_csv, _valid
from tests.gradcheck import assert_same_gradients, assert_same_loss, batch_for, mlp, reference
from zeropipe.core.ir import Kind, Schedule
from zeropipe.runtime.pipeline import Pipeline

CASES = [
    (name, ranks, m)
    for name in ["ScheduleGPipe", *_MULTI]
    for ranks in (2, 4)
    for m in (2 * ranks,)
    if _valid(name, ranks, m)
]


@pytest.mark.parametrize(("name", "ranks", "microbatches"), CASES)
def test_an_imported_torch_schedule_runs_with_the_reference_gradients(
    name: str, ranks: int, microbatches: int, tmp_path: Path
) -> None:
    schedule = Schedule.from_torch_csv(
        _torch_csv(name, ranks, microbatches, tmp_path), microbatches=microbatches, name=name
    )
    model = mlp()
    x, y = batch_for(model, batch=2 * microbatches)
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    kinds = {a.kind for acts in pipe.schedule.actions for a in acts}
    if name == "ScheduleGPipe":
        assert Kind.REDUCE_GRAD in kinds  # torch writes it; kept (a no-op without replicas)
    if name == "ScheduleDualPipeV":
        assert pipe.schedule.overlaps  # the OVERLAP_F_B pairs survived lowering
    ref_loss, ref = reference(model, x, y, F.mse_loss, microbatches)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        assert_same_loss(loss, ref_loss)
        assert_same_gradients(model.named_parameters(), ref)
