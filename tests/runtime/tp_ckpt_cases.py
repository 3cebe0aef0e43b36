"""What each rank runs in the tensor-parallel checkpoint tests (tests/runtime/checkpoint/test_tp_checkpoint.py).

The model is the built-in GPT, tiny and in float64, made tensor-parallel with
:func:`parallelize_gpt` over the mesh's "tp" dimension (Megatron's layout: q, k, v
and up cut by columns, proj and down by rows), trained by AdamW so that the
optimizer's moments are DTensors too and must be resharded on load.

    save_and_go_on(rank, world, path)   pp 2 x tp 2 (4 processes): STEPS_BEFORE steps, save
                                        to ``path``, then STEPS_AFTER more (the losses an
                                        uninterrupted run gives)
    resume_both(rank, world, path,      2 processes: load ``path`` at pp 2 x tp 1 and run
                scratch)                STEPS_AFTER steps, then load it again at pp 1 x tp 2
                                        and run them again; then the refusals of a load at
                                        tp 2 (a NaN in one shard, a GPT of another width)
    run(pipe, optimizer, steps)         the training loop of both (and of the test process)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zeropipe.apps.models.gpt import GPTConfig, gpt, lm_loss, parallelize_gpt
from zeropipe.core.passes.build import build_schedule
from zeropipe.runtime.checkpoint.dcp import load_checkpoint, save_checkpoint
from zeropipe.runtime.checkpoint.folder import CheckpointError
from zeropipe.runtime.checkpoint.names import state_names
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

CONFIG = GPTConfig(vocab=32, seq=8, width=16, heads=4, layers=2, dropout=0.0)
STEPS_BEFORE, STEPS_AFTER = 2, 3
MICROBATCHES = 4
OPTIONS = RuntimeOptions(seed=3, timeout=60.0)


def model(tp_mesh: Any = None) -> nn.Sequential:
    """The GPT in float64, tensor-parallel over ``tp_mesh`` when one is given."""
    m = gpt(CONFIG, seed=1).double()
    if tp_mesh is not None:
        parallelize_gpt(m, tp_mesh)
    return m


def batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CONFIG.vocab, (8, CONFIG.seq), generator=g)
    y = torch.randint(0, CONFIG.vocab, (8, CONFIG.seq), generator=g)
    return x, y


def pipeline(pp: int, tp: int) -> tuple[Pipeline, torch.optim.Optimizer]:
    """The GPT's pipeline over a (pp, tp) mesh of every process (``"local"`` for 1 x 1)."""
    mesh: Any = "local"
    tp_mesh = None
    if pp * tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
        tp_mesh = mesh["tp"] if tp > 1 else None
    schedule = build_schedule("1f1b", ranks=pp, microbatches=MICROBATCHES)
    pipe = Pipeline(model(tp_mesh), schedule, lm_loss, mesh=mesh, options=OPTIONS)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.02, weight_decay=0.01)


def run(pipe: Pipeline, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = pipe.step(*batch(step))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def save_and_go_on(rank: int, world: int, path: str) -> dict[str, Any]:
    pipe, opt = pipeline(2, 2)
    before = run(pipe, opt, range(STEPS_BEFORE))
    save_checkpoint(pipe, opt, path, extra={"step": STEPS_BEFORE})
    after = run(pipe, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    tensors = state_names(pipe).tensors
    sharded = sorted(n for n, t in tensors.items() if isinstance(t, DTensor))
    return {"before": before, "after": after, "sharded": sharded}


def resume_both(rank: int, world: int, path: str, scratch: str) -> dict[str, Any]:
    """Load ``path`` at pp 2 x tp 1 and at pp 1 x tp 2 and run on from it; then, at pp 1 x tp 2,
    what a load refuses: a GPT of another width, and a checkpoint with a NaN in one shard."""
    steps = range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    out: dict[str, Any] = {}
    for pp, tp in ((2, 1), (1, 2)):
        pipe, opt = pipeline(pp, tp)
        out[f"extra pp{pp} tp{tp}"] = load_checkpoint(pipe, opt, path)
        out[f"pp{pp} tp{tp}"] = run(pipe, opt, steps)
    # The tensor-parallel pipeline (pp 1 x tp 2) of the last pass: a NaN in rank 1's shard
    # of a weight only; every rank must refuse it, not rank 1 alone (rank 0 would go on).
    weight = state_names(pipe).tensors["1.q.weight"]
    assert isinstance(weight, DTensor)
    if rank == 1:
        with torch.no_grad():
            weight.to_local()[0, 0] = float("nan")
    save_checkpoint(pipe, opt, scratch)
    out["nan"] = _refusal(lambda: load_checkpoint(pipe, opt, scratch))
    wider = replace(CONFIG, width=24)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    other = gpt(wider, seed=1).double()
    parallelize_gpt(other, mesh["tp"])
    schedule = build_schedule("1f1b", ranks=1, microbatches=MICROBATCHES)
    pipe = Pipeline(other, schedule, lm_loss, mesh=mesh, options=OPTIONS)
    out["wider"] = _refusal(lambda: load_checkpoint(pipe, None, path))
    return out


def _refusal(load: Callable[[], object]) -> str:
    try:
        load()
    except CheckpointError as exc:
        return str(exc)
    return "loaded"
