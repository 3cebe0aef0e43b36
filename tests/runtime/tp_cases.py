"""What each rank runs in the tensor-parallel tests: pipeline ranks x tensor-parallel ranks.

One launch of 4 processes on a ("pp", "tp") = (2, 2) gloo mesh (``results``,
cached for the test session) runs every case and returns, per rank, losses
and the whole gradients (``full_tensor()`` of each DTensor gradient) of the
parameters its stages own; test_tensor_parallel.py compares them, in the
test process, with the plain, unparallel model (the same 4 processes also
form a ("pp", "dp", "tp") = (1, 2, 2) mesh: dp_shard under one process's
pipeline, ``_pp1_cases``).  Every process builds the
whole model and makes it tensor-parallel over ``mesh["tp"]`` as a user
would, with torch's ``parallelize_module``; the pipeline runs its rank's
stages.  A second launch of 8 processes on ("pp", "dp", "tp") = (2, 2, 2)
(``results_3d``) runs the pipeline inside torchtitan's 2-D FSDP x TP.

Models (float64, no dropout: a mask drawn on a shard is not the plain model's):

    tp      residual blocks LayerNorm-Linear-GELU-Linear: the first Linear
            column-wise, the second row-wise; boundaries carry whole tensors
    chain   blocks Linear-GELU-Linear without the residual: a row-wise output (an
            AsyncCollectiveTensor) goes straight into the next block, or across a boundary
    sp      the same blocks with sequence parallelism: LayerNorm on sequence
            shards, column-wise from and row-wise back to sequence shards; the
            first block cuts the sequence, the last gathers it, so every
            boundary between stages carries this tensor-parallel rank's shard
    sp-dt   as ``sp``, but each block returns a DTensor (``use_local_output=False``):
            the boundaries carry DTensors, sent as their local shard and rebuilt
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.gradcheck import whole_grads
from tests.runtime.dist_cases import guard, supported
from tests.runtime.dp_cases import outcome
from zeropipe.core.costs import CostModel
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.passes.fit import checkpoint, offload, offload_weights
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.planning.plan import auto_plan
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

PP, TP = 2, 2
WORLD = PP * TP
LAUNCH_TIMEOUT = 400.0
OPTIONS = RuntimeOptions(timeout=60.0)
M = 4  # microbatches
LAYERS, WIDTH, SEQ = 8, 8, 4


class Block(nn.Module):
    """A residual block whose inner layers are addressable by name (for the TP plans)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


def plain_model(kind: str = "tp") -> nn.Sequential:
    """The unparallel model of ``kind``: ``chain`` has no residual, so a row-wise linear's
    output (an AsyncCollectiveTensor) feeds the next block's column-wise one directly."""
    torch.manual_seed(2024)
    if kind == "chain":
        return nn.Sequential(
            *[
                nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
                for _ in range(LAYERS)
            ]
        ).double()
    return nn.Sequential(*[Block(WIDTH) for _ in range(LAYERS)]).double()


def batch(rows: int = 2 * M) -> tuple[Tensor, Tensor]:
    """(rows, sequence, width) inputs and targets: sequence parallelism cuts dim 1."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(rows, SEQ, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(rows, SEQ, WIDTH, generator=g, dtype=torch.float64)


def loss_fn(out: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(out, target)


def parallel_model(kind: str, tp_mesh: Any) -> nn.Sequential:
    """The plain model made tensor-parallel over ``tp_mesh`` as a user would."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = plain_model(kind)
    if kind == "chain":
        for block in model:
            parallelize_module(block, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return model
    if kind == "tp":
        for block in model:
            parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        return model
    local = kind == "sp"
    for block in model:
        parallelize_module(
            block,
            tp_mesh,
            {
                "norm": SequenceParallel(),
                "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1), use_local_output=local),
            },
        )
    # Into the first block: the whole sequence in, this rank's shard on; out of the last:
    # the shards gathered, so the loss sees the whole output.
    parallelize_module(
        model[0],
        tp_mesh,
        PrepareModuleInput(
            input_layouts=(Replicate(),),
            desired_input_layouts=(Shard(1),),
            use_local_output=local,
        ),
    )
    parallelize_module(
        model[-1],
        tp_mesh,
        PrepareModuleOutput(
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True
        ),
    )
    return model


def _schedule(name: str, model: nn.Sequential, variant: str, mesh: Any) -> Any:
    if name == "auto" and variant == "profiled":
        # every process profiles its TP shard of the model; process 0's plan is everyone's
        x, y = batch()
        plan = auto_plan(model, PP, M, sample=(x, y), loss_fn=loss_fn,
                         process_group=mesh["pp"].get_group())  # fmt: skip
        return plan.schedule, plan.balance
    if name == "auto":
        return auto_plan(model, PP, M, costs=CostModel.uniform(PP)).schedule
    if variant == "plain":
        return name
    base = generate(name, PP, M)
    if variant == "recompute":
        return checkpoint(base)
    if variant == "offload":
        return offload(base)
    raise ValueError(variant)


def _grad_case(mesh: Any, kind: str, name: str, variant: str = "plain",
               options: RuntimeOptions = OPTIONS) -> dict[str, Any]:  # fmt: skip
    """Two steps: each step's loss and this rank's whole gradients (with activation offload:
    also how many saved DTensors had their local shard moved and rebuilt)."""
    from zeropipe.runtime.memory import offload as offload_module

    rebuilt = [0]
    rebuild = offload_module._Shard.rebuild

    def counted(self: Any, local: Tensor) -> Tensor:
        rebuilt[0] += 1
        return rebuild(self, local)

    offload_module._Shard.rebuild = counted  # type: ignore[method-assign]
    try:
        out = _two_steps(mesh, kind, name, variant, options)
    finally:
        offload_module._Shard.rebuild = rebuild  # type: ignore[method-assign]
    return {**out, "dtensors_moved": rebuilt[0]}


def _two_steps(mesh: Any, kind: str, name: str, variant: str,
               options: RuntimeOptions) -> dict[str, Any]:  # fmt: skip
    model = parallel_model(kind, mesh["tp"])
    x, y = batch()
    schedule = _schedule(name, model, variant, mesh)
    schedule, cut = schedule if isinstance(schedule, tuple) else (schedule, None)
    pipe = Pipeline(
        model, schedule, loss_fn, microbatches=M, balance=cut, mesh=mesh, options=options
    )
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        steps.append({"loss": loss.item(), "grads": whole_grads(model)})
    kinds = sorted({a.kind.value for a in pipe.schedule.actions[pipe.rank]})
    return {"steps": steps, "kinds": kinds, "peak_saved": pipe.peak_saved_bytes[pipe.rank]}


def grid() -> list[tuple[str, str, str]]:
    """(model, schedule, variant) of the gradient cases."""
    out = [("tp", name, "plain") for name in sorted(GENERATORS) if supported(name, PP, M)]
    out += [("sp", name, "plain") for name in sorted(GENERATORS) if supported(name, PP, M)]
    out += [("chain", name, "plain") for name in ("1f1b", "zbv", "interleaved-zb")]
    out += [
        (kind, name, "recompute")
        for kind in ("tp", "sp")
        for name in ("1f1b", "zbv", "interleaved-zb")
    ]
    out += [("tp", name, "offload") for name in ("1f1b", "zbv")]
    out += [("tp", "auto", "profiled")]
    return out


def _clip_case(mesh: Any) -> dict[str, Any]:
    model = parallel_model("tp", mesh["tp"])
    x, y = batch()
    pipe = Pipeline(model, "zbv", loss_fn, microbatches=M, mesh=mesh, options=OPTIONS)
    out = {}
    for norm_type in (2.0, float("inf")):
        model.zero_grad(set_to_none=True)
        pipe.step(x, y)
        norm = pipe.clip_grad_norm_(1e-3, norm_type)
        out[str(norm_type)] = {"norm": norm.item(), "grads": whole_grads(model)}
    return out


def _refusals(mesh: Any) -> dict[str, str]:
    """Weight offload of DTensor parameters; a stage returning a DTensor across a boundary."""

    def dtensor_boundary() -> None:
        model = parallel_model("sp-dt", mesh["tp"])
        pipe = Pipeline(model, "1f1b", loss_fn, microbatches=M, mesh=mesh, options=OPTIONS)
        pipe.step(*batch())

    def different_schedules() -> None:
        tp = mesh.get_local_rank("tp")
        Pipeline(parallel_model("tp", mesh["tp"]), ("1f1b", "gpipe")[tp], loss_fn,
                 microbatches=M, mesh=mesh, options=OPTIONS)  # fmt: skip

    return {
        "different_schedules": outcome(different_schedules),
        "weight_offload": outcome(
            lambda: Pipeline(
                parallel_model("tp", mesh["tp"]),
                offload_weights(generate("1f1b", PP, M)),
                loss_fn,
                mesh=mesh,
                options=OPTIONS,
            )
        ),
        "dtensor_boundary": outcome(dtensor_boundary),
    }


def _sharded_steps(pipe: Pipeline, model: nn.Module, xs: Tensor, ys: Tensor) -> tuple[list, list]:
    """Two steps' losses and whole gradients, and the placements of the pipeline's DTensors."""
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(xs, ys)
        steps.append({"loss": loss.item(), "grads": whole_grads(model)})
    placements = sorted(
        {str(tuple(p.placements)) for p in pipe.parameters() if hasattr(p, "placements")}
    )
    return steps, placements


def _pp1_case(mesh: Any, name: str, ranks: int) -> dict[str, Any]:
    """dp_shard=True on ("pp", "dp", "tp") = (1, 2, 2): this process plays every pipeline rank
    of ``name`` built for ``ranks``; two steps on this replica's half of the global batch."""
    model = parallel_model("tp", mesh["tp"])
    x, y = batch(2 * M * DP)
    dp = mesh.get_local_rank("dp")
    xs, ys = torch.tensor_split(x, DP)[dp], torch.tensor_split(y, DP)[dp]
    schedule = build_schedule(name, ranks=ranks, microbatches=M)
    pipe = Pipeline(model, schedule, loss_fn, mesh=mesh, options=replace(OPTIONS, dp_shard=True))
    steps, placements = _sharded_steps(pipe, model, xs, ys)
    return {"steps": steps, "placements": placements}


def _pp1_cases() -> dict[str, Any]:
    """The same 4 processes as a (1, 2, 2) mesh: FSDP2 x TP under one process's pipeline."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    out: dict[str, Any] = {d: mesh.get_local_rank(d) for d in ("dp", "tp")}
    out["grads"] = {
        f"{name}/ranks={ranks}": guard(functools.partial(_pp1_case, mesh, name, ranks))
        for name, ranks in PP1_GRID
    }
    return out


# a one-rank V (both stages of a rank in one FSDP unit) and two pipeline ranks in one process
PP1_GRID = (("zbv", 1), ("1f1b", 2))


def cases(rank: int, world: int) -> dict[str, Any]:
    """Everything the 4-process launch runs (per rank: its results)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    out: dict[str, Any] = {"pp": mesh.get_local_rank("pp"), "tp": mesh.get_local_rank("tp")}
    out["grads"] = {"/".join(c): guard(functools.partial(_grad_case, mesh, *c)) for c in grid()}
    out["grads"]["tp/zbv/ordered"] = guard(
        functools.partial(_grad_case, mesh, "tp", "zbv", options=replace(OPTIONS, p2p="ordered"))
    )
    out["grads"]["tp/zbv/no-grad-memory"] = guard(
        functools.partial(_grad_case, mesh, "tp", "zbv",
                          options=replace(OPTIONS, keep_grad_memory=False))
    )  # fmt: skip
    out["clip"] = guard(lambda: _clip_case(mesh))
    out["refusals"] = guard(lambda: _refusals(mesh))
    out["pp1"] = _pp1_cases()
    return out


@functools.cache
def results() -> list[dict[str, Any]]:
    """``cases`` on 4 processes, launched once per test session."""
    from zeropipe.runtime.launch import launch

    return launch(cases, WORLD, timeout=LAUNCH_TIMEOUT)


# -- pipeline x FSDP2 x TP: ("pp", "dp", "tp") = (2, 2, 2) ---------------------------------

DP = 2
WORLD_3D = PP * DP * TP


def _grad_case_3d(mesh: Any, name: str, shard: bool) -> dict[str, Any]:
    """Two steps on this replica's half of the global batch: losses and whole gradients."""
    model = parallel_model("tp", mesh["tp"])
    x, y = batch(2 * M * DP)
    dp = mesh.get_local_rank("dp")
    xs, ys = torch.tensor_split(x, DP)[dp], torch.tensor_split(y, DP)[dp]
    pipe = Pipeline(
        model, name, loss_fn, microbatches=M, mesh=mesh, options=replace(OPTIONS, dp_shard=shard)
    )
    steps, placements = _sharded_steps(pipe, model, xs, ys)
    return {"steps": steps, "placements": placements, "clip": pipe.clip_grad_norm_(1e9).item()}


def cases_3d(rank: int, world: int) -> dict[str, Any]:
    """What the 8-process launch runs: dp_shard=True under 1f1b and zbv, replicas under 1f1b."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    out: dict[str, Any] = {n: mesh.get_local_rank(n) for n in ("pp", "dp", "tp")}
    grid = [("1f1b", True), ("zbv", True), ("1f1b", False)]
    out["grads"] = {
        f"{name}/{'shard' if shard else 'replicas'}": guard(
            functools.partial(_grad_case_3d, mesh, name, shard)
        )
        for name, shard in grid
    }
    return out


@functools.cache
def results_3d() -> list[dict[str, Any]]:
    """``cases_3d`` on 8 processes, launched once per test session."""
    from zeropipe.runtime.launch import launch

    return launch(cases_3d, WORLD_3D, timeout=LAUNCH_TIMEOUT)


# -- a failing rank of a tensor-parallel group -----------------------------------------------

FAILING = 1  # global rank: pipeline rank 0, tensor-parallel rank 1
FAIL_TIMEOUT = 10.0


class _Fail(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("injected failure on a tensor-parallel rank")


def failing(rank: int, world: int, p2p: str) -> dict[str, Any]:
    """Rank ``FAILING`` raises inside its first stage's forward, between TP collectives; its
    tensor-parallel peer is then inside one.  Every rank's outcome is the launch's error."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    model = parallel_model("tp", mesh["tp"])
    if rank == FAILING:
        model[1].down.register_forward_pre_hook(lambda _m, _a: _Fail()(_a[0]))
    pipe = Pipeline(model, "1f1b", loss_fn, microbatches=M, mesh=mesh,
                    options=replace(OPTIONS, timeout=FAIL_TIMEOUT, p2p=p2p))  # fmt: skip
    pipe.step(*batch())
    return {"finished": True}
