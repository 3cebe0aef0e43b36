"""Where a process computes: ``resolve_device``'s decision, checked without a GPU.

The GPU count and the environment are parameters of
:func:`zeropipe.base.device.resolve_device`, so every branch -- an NCCL group
picking ``cuda:LOCAL_RANK``, and each launch that cannot work -- is exercised
here on CPU; tests/test_gpu.py runs the real placement on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.gradcheck import assert_same_gradients, assert_same_loss, batch_for, mlp, reference
from zeropipe import Pipeline, RuntimeOptions, build_schedule
from zeropipe.base.device import resolve_device, single_device
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.mesh import compute_device
from zeropipe.runtime.parts import build_stages

GPU = "cuda"


def test_nccl_computes_on_the_local_rank_gpu() -> None:
    for local in range(4):
        got = resolve_device(None, "nccl", device_count=4, env={"LOCAL_RANK": str(local)})
        assert got == torch.device(GPU, local)
    # A multi-backend group ("cpu:gloo,cuda:nccl") counts as NCCL; no LOCAL_RANK means 0.
    assert resolve_device(None, f"cpu:gloo,{GPU}:nccl", device_count=1, env={}) == torch.device(
        GPU, 0
    )


def test_without_nccl_nothing_given_means_where_the_parameters_are() -> None:
    assert resolve_device(None, None, device_count=0, env={}) is None
    assert resolve_device(None, "gloo", device_count=8, env={"LOCAL_RANK": "3"}) is None


def test_a_device_type_alone_takes_the_local_rank_and_a_full_device_is_kept() -> None:
    assert resolve_device(GPU, "gloo", device_count=2, env={"LOCAL_RANK": "1"}) == torch.device(
        GPU, 1
    )
    assert resolve_device(GPU, None, device_count=1, env={}) == torch.device(GPU, 0)
    assert resolve_device(f"{GPU}:1", "nccl", device_count=2, env={"LOCAL_RANK": "0"}) == (
        torch.device(GPU, 1)
    )
    assert resolve_device("cpu", "gloo", device_count=0, env={}) == torch.device("cpu")
    assert resolve_device(torch.device("cpu"), None) == torch.device("cpu")


def test_more_processes_than_gpus_names_the_fix() -> None:
    with pytest.raises(PipelineError) as err:
        resolve_device(None, "nccl", device_count=2, env={"LOCAL_RANK": "3"})
    msg = str(err.value)
    assert "LOCAL_RANK=3" in msg and "2" in msg
    assert "--nproc-per-node=2" in msg and "CUDA_VISIBLE_DEVICES" in msg and "device=" in msg


def test_no_gpu_at_all_names_the_fix() -> None:
    with pytest.raises(PipelineError, match=r"sees none.*gloo"):
        resolve_device(None, "nccl", device_count=0, env={"LOCAL_RANK": "0"})
    with pytest.raises(PipelineError, match="sees none"):
        resolve_device(GPU, None, device_count=0, env={})


def test_a_cpu_device_with_nccl_is_refused() -> None:
    with pytest.raises(PipelineError, match=r"NCCL moves GPU tensors only.*gloo"):
        resolve_device("cpu", "nccl", device_count=2, env={})


def test_a_gpu_index_that_does_not_exist_is_refused() -> None:
    with pytest.raises(PipelineError, match=r"does not exist.*2"):
        resolve_device(f"{GPU}:2", None, device_count=2, env={})


@pytest.mark.parametrize("value", ["x", "-1"])
def test_a_bad_local_rank_is_refused(value: str) -> None:
    with pytest.raises(PipelineError, match=f"LOCAL_RANK={value!r}.*torchrun"):
        resolve_device(None, "nccl", device_count=2, env={"LOCAL_RANK": value})


def test_not_a_device_is_refused() -> None:
    with pytest.raises(PipelineError, match="not a device"):
        resolve_device("nowhere:0", None)


def test_mixed_parameter_devices_are_refused_with_the_fix() -> None:
    assert single_device([], "nothing") is None
    cpu = torch.device("cpu")
    assert single_device([cpu, cpu], "x") == cpu
    with pytest.raises(
        PipelineError, match=r"several devices \(cpu, meta\).*RuntimeOptions\(device="
    ):
        single_device([cpu, torch.device("meta")], "the parameters of stage(s) 0")
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to("meta"))
    stages = dict(enumerate(build_stages(model, 2, None)))
    with pytest.raises(PipelineError, match=r"stage\(s\) 0, 1 are on several devices"):
        compute_device(None, False, None, stages)
    # Through Pipeline, a stage left on meta (holding no values) is refused first, by name.
    with pytest.raises(PipelineError, match=r"stage 1's parameter '0.weight' is on the meta"):
        Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=F.mse_loss)


def test_an_explicit_device_moves_the_stages_and_the_batch() -> None:
    # On CPU the move is the identity; what is checked is that device= is taken, the
    # stages are placed, and a batch on that device gives the reference gradients.
    model = mlp(layers=4)
    x, y = batch_for(model, batch=8)
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
    pipe = Pipeline(
        model,
        build_schedule("1f1b", ranks=2, microbatches=4),
        loss_fn=F.mse_loss,
        options=RuntimeOptions(device="cpu"),
    )
    assert pipe.device == torch.device("cpu")
    assert_same_loss(pipe.step(x, y), ref_loss)
    assert_same_gradients(model.named_parameters(), ref)
    assert (
        Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=F.mse_loss).device
        is None
    )
