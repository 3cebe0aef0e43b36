"""Training a model whose weights exceed a memory cap, by weight offload (OffloadModel's case).

The cap is the runtime's own accounting (``pipe.memory.report.weights``: the
peak bytes of parameters resident on the compute device during the step),
so this runs on CPU; tests/test_gpu.py repeats it under a real allocator cap
(``torch.cuda.set_per_process_memory_fraction``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.gradcheck import assert_same_gradients, assert_same_loss, batch_for, mlp, reference
from zeropipe import Pipeline
from zeropipe.core.passes.fit import offload_weights
from zeropipe.core.schedules import generate

STAGES = 8


@pytest.mark.parametrize("prefetch", [1, 2])
def test_resident_weights_stay_under_a_cap_smaller_than_the_model(prefetch: int) -> None:
    model = mlp(layers=16)  # float64, 8 equal stages of 2 residual blocks
    x, y = batch_for(model, batch=8)
    ref_loss, _ = reference(model, x, y, F.mse_loss, 4)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    stage_bytes = model_bytes // STAGES
    # The stage computing and the ``prefetch`` stages being fetched: no more may be resident.
    cap = (1 + prefetch) * stage_bytes
    assert cap < model_bytes

    plain = Pipeline(model, generate("looped-bfs", 1, 4, chunks=STAGES), loss_fn=F.mse_loss)
    plain.step(x, y)
    assert plain.memory.report.weights == (model_bytes,)  # without offload: over the cap
    model.zero_grad(set_to_none=True)

    schedule = offload_weights(generate("looped-bfs", 1, 4, chunks=STAGES), prefetch=prefetch)
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    # Gradient memory kept between steps would pin every stage's gradient on the device.
    assert pipe.grad_memory is None
    for step in range(2):
        model.zero_grad(set_to_none=True)
        _, ref_step = reference(model, x, y, F.mse_loss, 4, step=step)
        loss = pipe.step(x, y)
        if step == 0:
            assert_same_loss(loss, ref_loss)
        assert_same_gradients(model.named_parameters(), ref_step)
        (weights,) = pipe.memory.report.weights
        assert 0 < weights <= cap < model_bytes, (weights, cap, model_bytes)
        # An optimizer steps the host copies between steps; the next step reloads them.
        with torch.no_grad():
            for p in model.parameters():
                assert p.grad is not None
                p -= 0.1 * p.grad


def test_the_example_trains_with_a_quarter_of_the_weights_resident() -> None:
    script = Path(__file__).resolve().parents[3] / "examples" / "offload_model.py"
    out = subprocess.run(
        [sys.executable, str(script), "--steps", "6"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step")]
    assert losses[-1] < losses[0], losses
    words = lines[-1].split()
    resident, total = int(words[-5]), int(words[-3])
    assert resident * 4 == total, lines[-1]  # 2 of 8 stages


def test_the_offload_benchmark_runs_on_cpu() -> None:
    # A smoke run (no timing is judged): the table has every variant and a ratio each.
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "offload.py"
    args = ["--reps", "1", "--stages", "2", "--layers", "1", "--hidden", "16", "--rows", "4"]
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split("  ")[0].strip(): line for line in out.stdout.splitlines()[2:]}
    assert set(rows) == {"resident", "W-offload p1", "W-offload p0", "A-offload p1"}, out.stdout
    assert rows["resident"].split()[2] == "1.000"
