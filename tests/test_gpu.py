"""The CUDA paths, on a real GPU: placement, copy streams, pinned memory, the allocator cap.

Every test here is marked ``gpu`` and skipped where ``torch.cuda.is_available()``
is false (tests/conftest.py).  On a GPU machine::

    python -m pytest -q -m gpu -rs tests/test_gpu.py

float64 on the GPU keeps the comparisons with the reference exact (~1e-12), so a
copy that is read before it has landed (a missing event wait or record_stream)
shows up as a wrong gradient, not as noise.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.gradcheck import assert_same_gradients, assert_same_loss, batch_for, mlp, reference
from tests.runtime.test_autocast import BF16, assert_bf16_gradients, splits
from zeropipe import Pipeline, RuntimeOptions, build_schedule
from zeropipe.core.passes.fit import offload, offload_weights
from zeropipe.core.schedules import GENERATORS, generate

pytestmark = pytest.mark.gpu

GPU = torch.device("cuda", 0)
NAMED = sorted(n for n in GENERATORS if n != "auto")


def _on_gpu(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0].to(GPU), batch[1].to(GPU)


@pytest.mark.parametrize("name", NAMED)
def test_every_schedule_on_one_gpu_is_exact(name: str) -> None:
    model = mlp(layers=8, dropout=0.1).to(GPU)  # dropout: the GPU generator is seeded per layer
    x, y = _on_gpu(batch_for(model, batch=8))
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
    pipe = Pipeline(model, build_schedule(name, ranks=2, microbatches=4), loss_fn=F.mse_loss)
    assert pipe.memory.step_device() == GPU
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
    assert all(p.grad is not None and p.grad.device == GPU for p in model.parameters())


def test_device_cuda_moves_the_stages_and_the_batch() -> None:
    model = mlp(layers=4)
    x, y = batch_for(model, batch=8)  # on the host: the pipeline moves them
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
    pipe = Pipeline(
        model,
        build_schedule("zb-h1", ranks=2, microbatches=4),
        loss_fn=F.mse_loss,
        options=RuntimeOptions(device="cuda"),
    )
    assert pipe.device == GPU
    assert all(p.device == GPU for p in model.parameters())
    assert_same_loss(pipe.step(x, y).cpu(), ref_loss)
    assert_same_gradients(model.named_parameters(), {k: v.to(GPU) for k, v in ref.items()})


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv"])
def test_activation_offload_on_the_gpu_is_exact(name: str) -> None:
    model = mlp(layers=8, dropout=0.1).to(GPU)
    x, y = _on_gpu(batch_for(model, batch=8))
    ref_loss, _ = reference(model, x, y, F.mse_loss, 4)
    schedule = offload(generate(name, 2, 4), prefetch=1)  # every (stage, microbatch)
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)
    for step in range(2):  # the second step reuses the copy stream and the pinned buffers' pool
        model.zero_grad(set_to_none=True)
        _, ref_step = reference(model, x, y, F.mse_loss, 4, step=step)
        loss = pipe.step(x, y)
        if step == 0:
            assert_same_loss(loss, ref_loss)
        assert_same_gradients(model.named_parameters(), ref_step)
        assert max(pipe.memory.report.host) > 0
        assert pipe.memory.report.allocated is not None


def test_weight_offload_on_the_gpu_is_exact_and_leaves_weights_on_the_host() -> None:
    model = mlp(layers=8)  # built on the host, where it stays between steps (no dropout:
    # the reference runs on the host, whose generator draws other masks than the GPU's)
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
    schedule = offload_weights(generate("looped-bfs", 1, 4, chunks=4))
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss, options=RuntimeOptions(device="cuda"))
    assert_same_loss(pipe.step(x, y).cpu(), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
    for p in model.parameters():
        assert p.device.type == "cpu" and p.is_pinned()  # async copies need pinned memory
        assert p.grad is not None and p.grad.device.type == "cpu"
    stage_bytes = sum(p.numel() * 8 for p in pipe.stages[0].parameters())
    assert pipe.memory.report.weights == (2 * stage_bytes,)


def test_weight_offload_trains_a_model_larger_than_the_allocator_cap() -> None:
    cap = 3 << 29  # 1.5 GiB of device memory for this process
    total = torch.cuda.get_device_properties(GPU).total_memory
    model = mlp(layers=16, width=2048)  # float64: 16 blocks of 4 * 2048**2 weights = 2 GiB
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert model_bytes > cap
    x, y = batch_for(model, batch=8)
    reference_model = copy.deepcopy(model)
    schedule = offload_weights(generate("looped-bfs", 1, 4, chunks=8))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(cap / total, GPU)
    try:
        pipe = Pipeline(model, schedule, loss_fn=F.mse_loss, options=RuntimeOptions(device="cuda"))
        for step in range(2):
            model.zero_grad(set_to_none=True)  # as an optimizer's zero_grad would
            ref_loss, ref = reference(reference_model, x, y, F.mse_loss, 4, step=step)
            loss = pipe.step(x, y)
            assert_same_loss(loss.cpu(), ref_loss)
            assert_same_gradients(model.named_parameters(), ref)
            peak = pipe.memory.report.allocated
            assert peak is not None and peak <= cap < model_bytes, (peak, cap, model_bytes)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, GPU)
        torch.cuda.empty_cache()


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv"])
def test_bf16_autocast_on_the_gpu(name: str) -> None:
    model = mlp(layers=8, dtype=torch.float32).to(GPU)
    x, y = _on_gpu(batch_for(model, batch=8))
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4, autocast=torch.bfloat16)
    pipe = Pipeline(
        model, build_schedule(name, ranks=2, microbatches=4), loss_fn=F.mse_loss, options=BF16
    )
    loss = pipe.step(x, y)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_bf16_gradients(model, ref, split=splits(name))
