"""What each rank runs in the data-parallel tests: 2 pipeline ranks x 2 replicas (4 processes).

One launch (``results``, cached for the test session) runs every case in
turn inside the ranks and returns losses and gradients; the tests in
test_data_parallel.py compare them, in the test process, with the plain
model run on the *global* batch (and test_step_agreement.py reads the replicas
out of step, run last).  The mesh is torchtitan's order, pipeline
outermost: rank = pp * DP + dp, so replica ``dp``'s pipeline is ranks
``dp`` and ``DP + dp``.

Replica ``d`` gets rows ``tensor_split(x, DP)[d]`` of the global batch, as a
distributed sampler would give it, and numbers its microbatches from
``d * m`` (what dropout is seeded by), so the reference run microbatch by
microbatch over the global batch draws the same masks.

Run as a module under torchrun it is the two-launch "multi-node" script:
each launch plays one node of two processes (``--nnodes 2 --node-rank K``)
and rank 0 writes the cases' results to the file named by ZEROPIPE_DP_OUT.
"""

from __future__ import annotations

import functools
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from tests.gradcheck import batch_for, mlp, token_loss, token_model
from tests.runtime.dist_cases import MODELS, guard, supported
from tests.runtime.transport import agreement_cases
from zeropipe import Microbatches, build_schedule, causal_lm_loss
from zeropipe.core.costs import CostModel
from zeropipe.core.errors import PipelineError
from zeropipe.core.passes.fit import offload_weights
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.planning.plan import auto_plan
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

PP, DP = 2, 2
WORLD = PP * DP
OPTIONS = RuntimeOptions(timeout=60.0)
LAUNCH_TIMEOUT = 300.0
SEED = 5
SEEDED = replace(OPTIONS, seed=SEED)


def _replicas_only() -> Any:
    """A mesh whose "pp" dimension is one process: each process a replica of a whole pipeline."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("pp", "dp"))


def outcome(make: Callable[[], object]) -> str:
    """What building something says: its PipelineError's message, or "accepted"."""
    try:
        make()
    except PipelineError as err:
        return str(err)
    return "accepted"


def grid() -> list[tuple[str, str, int]]:
    """Every (generator, model, microbatches per replica) the gradient test covers."""
    return [
        (name, model, m)
        for name in sorted(GENERATORS)
        for model in sorted(MODELS)
        for m in (PP, 2 * PP + 1)
        if supported(name, PP, m)
    ]


def global_batch(model: nn.Sequential, m: int) -> tuple[Tensor, Tensor]:
    """A global batch every replica's microbatches cut evenly: 2 rows per microbatch."""
    return batch_for(model, batch=2 * m * DP)


def replica_slice(t: Tensor, dp: int) -> Tensor:
    return torch.tensor_split(t, DP)[dp]


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))


def _owned_grads(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_case(mesh: Any, dp: int, name: str, model_name: str, m: int) -> dict[str, Any]:
    """Two steps (the second with boundary shapes learnt): loss and this rank's gradients."""
    build, loss_fn = MODELS[model_name]
    model = build()
    x, y = global_batch(model, m)
    schedule = (
        auto_plan(model, PP, m, costs=CostModel.uniform(PP)).schedule if name == "auto" else name
    )
    pipe = Pipeline(model, schedule, microbatches=m, loss_fn=loss_fn, mesh=mesh, options=SEEDED)
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(replica_slice(x, dp), replica_slice(y, dp))
        steps.append({"loss": loss.item(), "grads": _owned_grads(model)})
    return {"steps": steps, "reductions": _reductions(pipe)}


FSDP_SCHEDULES = tuple(sorted(GENERATORS))
BOTH_MODELS = ("1f1b", "gpipe", "interleaved-1f1b", "zbv")  # the others: the tied model only


def fsdp_grid() -> list[tuple[str, str, int]]:
    """The (schedule, model, microbatches per replica) the dp_shard test covers."""
    return [
        (name, model, m)
        for name in FSDP_SCHEDULES
        for model in sorted(MODELS)
        for m in (2 * PP,)
        if supported(name, PP, m) and (name in BOTH_MODELS or model == "tokens-tied")
    ]


def _canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name a parameter is reachable by -> its first name (a tied weight has several)."""
    first: dict[int, str] = {}
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[n] = first.setdefault(id(p), n)
    return out


def _full_grads(model: nn.Module, canonical: dict[str, str]) -> dict[str, Tensor]:
    """This rank's gradients, gathered whole from their DTensor shards, by canonical name."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Tensor] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.grad is None:
            continue
        g = p.grad
        if not isinstance(g, DTensor) or not isinstance(p, DTensor):
            raise TypeError(f"{n}: a dp_shard gradient is not a DTensor shard ({type(g)})")
        out.setdefault(canonical[n], g.full_tensor())
    return out


def _fsdp_case(mesh: Any, dp: int, name: str, model_name: str, m: int) -> dict[str, Any]:
    """dp_shard=True: two steps; the loss and this rank's gradients gathered from the shards."""
    build, loss_fn = MODELS[model_name]
    model = build()
    canonical = _canonical_names(model)
    x, y = global_batch(model, m)
    schedule = (
        auto_plan(model, PP, m, costs=CostModel.uniform(PP)).schedule if name == "auto" else name
    )
    pipe = Pipeline(
        model, schedule, microbatches=m, loss_fn=loss_fn, mesh=mesh,
        options=replace(SEEDED, dp_shard=True),
    )  # fmt: skip
    steps = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(replica_slice(x, dp), replica_slice(y, dp))
        assert pipe.sharded is not None
        steps.append(
            {
                "loss": loss.item(),
                "grads": _full_grads(model, canonical),
                "reduced": list(pipe.sharded.reduced),
            }
        )
    params = pipe.parameters()
    return {
        "steps": steps,
        "reductions": _reductions(pipe),
        "units": len(pipe.sharded.units) if pipe.sharded is not None else 0,
        # held between steps: this rank's shards, and the whole parameters they are cut from
        "local_numel": sum(p.to_local().numel() for p in params),  # type: ignore[attr-defined]
        "full_numel": sum(p.numel() for p in params),
    }


LR = 0.5


def _fsdp_train_case(mesh: Any, dp: int, name: str) -> dict[str, Any]:
    """dp_shard=True under an optimizer: SGD on the shards, a step on the updated weights,
    one more step without zero_grad (gradients add up), then eval_step."""
    from torch.distributed.tensor import DTensor

    model = token_model()
    canonical = _canonical_names(model)
    x, y = global_batch(model, 4)
    xs, ys = replica_slice(x, dp), replica_slice(y, dp)
    pipe = Pipeline(
        model, name, microbatches=4, loss_fn=token_loss, mesh=mesh,
        options=replace(OPTIONS, dp_shard=True),
    )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    pipe.step(xs, ys)
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = pipe.step(xs, ys).item()  # on the weights SGD updated
    grads = _full_grads(model, canonical)
    pipe.step(xs, ys)
    twice = _full_grads(model, canonical)
    eval_loss = pipe.eval_step(xs, ys)
    return {
        "loss": loss,
        "grads": grads,
        "twice": twice,
        "eval_loss": None if eval_loss is None else float(eval_loss.item()),  # type: ignore[union-attr]
        "sharded_after_eval": all(isinstance(p, DTensor) for p in pipe.parameters()),
        "checkpoint": _checkpoint_refusal(pipe),
    }


def _checkpoint_refusal(pipe: Pipeline) -> str:
    """Saving a sharded pipeline is refused before anything is written."""
    from zeropipe.runtime.checkpoint.dcp import save_checkpoint
    from zeropipe.runtime.checkpoint.folder import CheckpointError

    try:
        save_checkpoint(pipe, None, "/nonexistent/zeropipe-checkpoint")
    except CheckpointError as err:
        return str(err)
    return "accepted"


def _fsdp_refusals(mesh: Any) -> list[str]:
    messages = []
    for make in (
        lambda: Pipeline(mlp(), build_schedule("1f1b", ranks=2, microbatches=2),
                         loss_fn=F.mse_loss, mesh="local", options=RuntimeOptions(dp_shard=True)),
        lambda: Pipeline(mlp(), offload_weights(generate("1f1b", PP, 2)), loss_fn=F.mse_loss,
                         mesh=mesh, options=RuntimeOptions(device="cpu", dp_shard=True)),
    ):  # fmt: skip
        messages.append(outcome(make))
    return messages


def _reductions(pipe: Pipeline) -> list[str]:
    return [str(a) for a in pipe.schedule.actions[pipe.rank] if a.kind.value == "REDUCE_GRAD"]


def counted_targets(y: Tensor) -> Tensor:
    """Token targets with many more positions ignored in replica 1's rows than in replica 0's."""
    y = y.clone()
    rows = len(y)
    y[rows // 2 :, 1:] = -100  # replica 1: one counted token per row
    y[0, 0] = -100
    return y


def counted_loss(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """(sum over counted tokens, their count): a mean the pipeline weights by the count."""
    flat = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
    )
    return flat, counted(target)


def counted(target: Tensor) -> Tensor:
    return (target != -100).sum()


def _counted_case(mesh: Any, dp: int) -> dict[str, Any]:
    """A mean over counted tokens whose count differs between replicas: the global mean."""
    model = token_model()
    x, y = global_batch(model, 3)
    y = counted_targets(y)
    pipe = Pipeline(
        model,
        "zbv",
        microbatches=3,
        loss_fn=counted_loss,
        loss_count=counted,
        mesh=mesh,
        options=OPTIONS,
    )
    loss = pipe.step(replica_slice(x, dp), replica_slice(y, dp))
    return {"loss": loss.item(), "grads": _owned_grads(model)}


def _clip_case(mesh: Any, dp: int) -> dict[str, Any]:
    """clip_grad_norm_ after a step: the norm and the clipped gradients, tied head counted once."""
    model = token_model()
    x, y = global_batch(model, 4)
    pipe = Pipeline(model, "1f1b", microbatches=4, loss_fn=token_loss, mesh=mesh, options=OPTIONS)
    out: dict[str, Any] = {}
    for norm_type in (2.0, float("inf")):
        model.zero_grad(set_to_none=True)
        pipe.step(replica_slice(x, dp), replica_slice(y, dp))
        norm = pipe.clip_grad_norm_(0.05, norm_type)
        out[str(norm_type)] = {"norm": norm.item(), "grads": _owned_grads(model)}
    return out


def _accumulate_case(mesh: Any, dp: int) -> dict[str, Any]:
    """Two steps without zero_grad: the gradients add up, each step's summed once."""
    model = token_model()
    x, y = global_batch(model, 2)
    pipe = Pipeline(model, "zb-h1", microbatches=2, loss_fn=token_loss, mesh=mesh, options=OPTIONS)
    for _ in range(2):
        pipe.step(replica_slice(x, dp), replica_slice(y, dp))
    return {"grads": _owned_grads(model)}


def _local_case(rank: int) -> dict[str, Any]:
    """Every process a replica running a whole 2-rank pipeline locally (dp = 4)."""
    model = mlp()
    x, y = batch_for(model, batch=2 * 2 * WORLD)
    pipe = Pipeline(
        model,
        build_schedule("interleaved-1f1b", ranks=2, microbatches=2),
        loss_fn=F.mse_loss,
        mesh=_replicas_only(),
        options=OPTIONS,
    )
    i, n = pipe.batch_slice
    xs, ys = torch.tensor_split(x, n)[i], torch.tensor_split(y, n)[i]
    loss = pipe.step(xs, ys)
    return {
        "loss": loss.item(),
        "grads": _owned_grads(model),
        "dp_size": pipe.dp_size,
        "slice": pipe.batch_slice,
    }


def _local_shard_case(rank: int) -> dict[str, Any]:
    """dp_shard=True, every process a replica running a whole 2-rank pipeline locally (dp = 4):
    the embedding tied to the head is used by stages of both pipeline ranks, all in this process."""
    model = token_model()
    canonical = _canonical_names(model)
    x, y = batch_for(model, batch=2 * 2 * WORLD)
    pipe = Pipeline(
        model,
        build_schedule("1f1b", ranks=2, microbatches=2),
        loss_fn=token_loss,
        mesh=_replicas_only(),
        options=replace(OPTIONS, dp_shard=True),
    )
    xs, ys = torch.tensor_split(x, WORLD)[rank], torch.tensor_split(y, WORLD)[rank]
    loss = pipe.step(xs, ys)
    units = len(pipe.sharded.units) if pipe.sharded is not None else 0
    return {"loss": loss.item(), "grads": _full_grads(model, canonical), "units": units}


def _timeline_case(mesh: Any, dp: int) -> dict[str, Any]:
    """1f1b on a wider MLP: this rank's measured events of the second step, as (action, start,
    end) on the perf_counter clock every process on the machine shares."""
    model = mlp(layers=8, width=64)
    x, y = batch_for(model, batch=16)
    pipe = Pipeline(model, "1f1b", microbatches=4, loss_fn=F.mse_loss, mesh=mesh, options=OPTIONS)
    for _ in range(2):
        pipe.step(replica_slice(x, dp), replica_slice(y, dp))
    timeline = pipe.timeline()
    return {"events": [(str(e.action), e.lane, e.start, e.end) for e in timeline.events[pipe.rank]]}


# Replica d's microbatches, (rows, sequence length) each: the replicas' lengths and rows
# differ, and so do their counted tokens (the count of microbatches is the schedule's).
VARLEN_SHAPES = (((2, 5), (1, 9), (3, 2), (1, 7)), ((1, 3), (2, 6), (2, 4), (1, 11)))


def replica_microbatches(dp: int, vocab: int = 11) -> Microbatches:
    """Replica ``dp``'s own microbatches of token ids and labels, some labels ignored."""
    g = torch.Generator().manual_seed(300 + dp)
    ids = [torch.randint(0, vocab, shape, generator=g) for shape in VARLEN_SHAPES[dp]]
    labels = [t.clone() for t in ids]
    labels[1][0, :2] = -100
    return Microbatches(inputs=ids, targets=labels)


def _varlen_case(mesh: Any, dp: int) -> dict[str, Any]:
    """Each replica steps on its own microbatches of different lengths (``Microbatches``)."""
    model = token_model(layers=8)
    batches = replica_microbatches(dp)
    pipe = Pipeline(
        model,
        "zbv",
        microbatches=len(batches.inputs),
        loss_fn=causal_lm_loss,
        mesh=mesh,
        options=OPTIONS,
    )
    loss = pipe.step(batches)
    return {"loss": loss.item(), "grads": _owned_grads(model)}


def _files_case(mesh: Any, dp: int) -> list[str]:
    """The runtime files one plain 1f1b step enters on this rank (its third: the first learns
    shapes and counts saved bytes, the gradients are cleared before the one measured)."""
    from tests.runtime.test_step_files import runtime_files_entered

    model = mlp(layers=4, width=8)
    x, y = batch_for(model, batch=16)
    pipe = Pipeline(model, "1f1b", microbatches=4, loss_fn=F.mse_loss, mesh=mesh, options=OPTIONS)
    for _ in range(2):
        pipe.step(replica_slice(x, dp), replica_slice(y, dp))
    model.zero_grad(set_to_none=True)
    with runtime_files_entered() as files:
        pipe.step(replica_slice(x, dp), replica_slice(y, dp))
    return sorted(files)


def _refusals(mesh: Any) -> list[str]:
    messages = []
    for make in (
        lambda: Pipeline(mlp(), "1f1b", microbatches=2, loss_fn=F.mse_loss, mesh="global"),
        lambda: Pipeline(mlp(), "1f1b", microbatches=2, loss_fn=F.mse_loss, mesh=object()),
    ):
        messages.append(outcome(make))
    return messages


def cases(rank: int, world: int) -> dict[str, Any]:
    """Everything the 4-process launch runs (per rank: its results)."""
    mesh = _mesh()
    pp = mesh.get_local_rank("pp")
    dp = mesh.get_local_rank("dp")
    out: dict[str, Any] = {"pp": pp, "dp": dp}
    out["grads"] = {
        f"{name}/{model}/m={m}": guard(functools.partial(_grad_case, mesh, dp, name, model, m))
        for name, model, m in grid()
    }
    out["counted"] = guard(lambda: _counted_case(mesh, dp))
    out["varlen"] = guard(lambda: _varlen_case(mesh, dp))
    out["clip"] = guard(lambda: _clip_case(mesh, dp))
    out["accumulate"] = guard(lambda: _accumulate_case(mesh, dp))
    out["local"] = guard(lambda: _local_case(rank))
    out["local_shard"] = guard(lambda: _local_shard_case(rank))
    out["timeline"] = guard(lambda: _timeline_case(mesh, dp))
    out["files"] = guard(lambda: _files_case(mesh, dp))
    out["refusals"] = guard(lambda: _refusals(mesh))
    out["fsdp"] = {
        f"{name}/{model}/m={m}": guard(functools.partial(_fsdp_case, mesh, dp, name, model, m))
        for name, model, m in fsdp_grid()
    }
    out["fsdp_refusals"] = guard(lambda: _fsdp_refusals(mesh))
    out["fsdp_train"] = {
        name: guard(functools.partial(_fsdp_train_case, mesh, dp, name)) for name in ("1f1b", "zbv")
    }
    # Last, since one of them fails (in its own pipeline): replicas out of step, which
    # test_step_agreement.py reads.
    out["agreement"] = guard(lambda: agreement_cases.four_ranks(rank, world))
    return out


@functools.cache
def results() -> list[dict[str, Any]]:
    """``cases`` on 4 processes, launched once per test session."""
    from zeropipe.runtime.launch import launch

    return launch(cases, WORLD, timeout=LAUNCH_TIMEOUT)


def _torchrun_main() -> None:
    """Under torchrun (one launch per "node"): run the gradient cases, rank 0 writes them."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != WORLD:
        sys.exit(f"dp_cases needs {WORLD} processes in all, got {world}")
    mesh = _mesh()
    dp = mesh.get_local_rank("dp")
    # every generator on the tied model, at its largest count (2p + 1, or dualpipe's even
    # 2p); the MLP too for two of them
    cases = grid()
    largest = {name: max(m for n, _, m in cases if n == name) for name, _, _ in cases}
    picked = [
        c
        for c in cases
        if c[2] == largest[c[0]] and (c[1] == "tokens-tied" or c[0] in ("zbv", "1f1b"))
    ]
    mine = {
        f"{name}/{model}/m={m}": guard(functools.partial(_grad_case, mesh, dp, name, model, m))
        for name, model, m in picked
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"pp": mesh.get_local_rank("pp"), "dp": dp, "grads": mine})
    if rank == 0:
        with open(os.environ["ZEROPIPE_DP_OUT"], "wb") as fh:
            pickle.dump(gathered, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    _torchrun_main()
