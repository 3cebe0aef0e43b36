"""What each rank runs in the expert-parallel tests (tests/adapters/test_ep.py).

Two launches, each cached for the test session:

- ``two_processes`` (2 ranks, ep 2, no pipeline): Qwen3-MoE, Mixtral and
  DeepSeek-V3 in float64, each rank on its half of the batch, loss = CE sum /
  global token count; and one experts module whose every routing points at rank
  0's experts (rank 1 receives no rows); experts sharded twice, refused.
- ``four_processes`` (pp 2 x dp 2, ep 2 inside dp: ``ep_mesh=mesh["dp"]``):
  Qwen3-MoE with its router loss under 1f1b, zbv and 1f1b with every forward
  recomputed, clip_grad_norm_, and a DCP
  checkpoint saved at ep 2 and loaded at ep 1 (plain experts) on the same mesh;
  dualpipev with its overlapped pairs run at once and in sequence; 1f1b with
  ``dp_shard=True`` (FSDP2 over "dp", the experts left whole); then pp 1 x dp 4 with
  the experts over blocks of 2 replicas (ep 2 < dp 4), replicated and with dp_shard (the
  experts sharded over the replicas holding them, or whole on an ep mesh of their own).

Each rank returns the differences from the unsplit, unsharded model it computes
itself, and what it holds (placements, local shapes, rows received), so the test
can check that experts were really sharded.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import zeropipe
from tests.adapters import hf_cases, hf_moe_cases
from tests.gradcheck import whole_grads
from tests.runtime.dist_cases import guard
from zeropipe.adapters.ep import shard_experts
from zeropipe.core.errors import PipelineError
from zeropipe.core.passes.fit import checkpoint

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
EXPERTS = 4  # every model of hf_moe_cases
LAUNCH_TIMEOUT = 300.0


def _scale(t: Tensor) -> float:
    """DeepSeek-V3's router weights are float32: their differences count at float32's scale."""
    return 1.0 if t.dtype == torch.float64 else 1e-5


def _local(t: Tensor) -> Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _expert_errors(
    model: nn.Module, ref: dict[str, Tensor], shard: int, mine: set[int] | None = None
) -> dict[str, Any]:
    """Largest gradient difference: an expert shard against the reference's slice, every
    other gradient against the reference's whole one.  Also what was sharded."""
    worst, checked, sharded = 0.0, 0, {}
    for name, p in model.named_parameters():
        if (mine is not None and id(p) not in mine) or p.grad is None:
            continue
        grad = _local(p.grad)
        want = ref[name]
        if grad.shape != want.shape:  # an expert shard: this rank's experts
            rows = grad.shape[0]
            want = want[shard * rows : (shard + 1) * rows]
            sharded[name] = [list(_local(p).shape), str(p.placements[0])]  # type: ignore[attr-defined]
        worst = max(worst, (grad - want).abs().max().item() * _scale(grad))
        checked += 1
    return {"grad": worst, "checked": checked, "sharded": sharded}


def _family(arch: str, rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """One family, ep 2, no pipeline: rank losses summed and non-expert gradients summed
    over ranks equal the whole batch's on the unsharded model."""
    ids, labels = hf_cases.batch(0, 8)
    total = zeropipe.causal_lm_loss.count(labels)
    reference = hf_moe_cases.build(arch, aux=False)
    ref_loss = zeropipe.causal_lm_loss.sum_and_count(reference(ids).logits, labels)[0] / total
    ref_loss.backward()
    ref = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    model = hf_moe_cases.build(arch, aux=False)
    zeropipe.parallelize(model, ep_mesh=mesh)
    x, y = torch.tensor_split(ids, world)[rank], torch.tensor_split(labels, world)[rank]
    loss = zeropipe.causal_lm_loss.sum_and_count(model(x).logits, y)[0] / total
    loss.backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    for p in model.parameters():  # the data-parallel sum of the non-expert gradients
        if p.grad is not None and not hasattr(p.grad, "to_local"):
            dist.all_reduce(p.grad)
    out = _expert_errors(model, ref, rank)
    out["loss"] = abs(summed.item() - ref_loss.item())
    out["names"] = len(ref)
    return out


def _one_sided(rank: int, world: int, mesh: Any) -> dict[str, Any]:
    """One experts module whose routing picks only rank 0's experts: rank 1 holds experts
    no row reaches, and receives no rows.  Output, input, routing-weight and expert
    gradients equal the eager module's on each rank's rows."""
    experts = hf_moe_cases.build("qwen3_moe", aux=False).model.layers[0].mlp.experts
    eager = hf_moe_cases.build("qwen3_moe", aux=False).model.layers[0].mlp.experts
    shard_experts([experts], mesh)
    local = EXPERTS // world

    def inputs(r: int) -> tuple[Tensor, Tensor, Tensor]:
        g = torch.Generator().manual_seed(100 + r)
        h = torch.randn(5 + r, 16, dtype=torch.float64, generator=g, requires_grad=True)
        index = torch.stack([torch.randperm(local, generator=g)[:2] for _ in range(5 + r)])
        w = torch.rand(5 + r, 2, dtype=torch.float64, generator=g, requires_grad=True)
        return h, index, w

    out: dict[str, Any] = {}
    for r in range(world):  # the eager module on every rank's rows: its gradients summed
        h, index, w = inputs(r)
        y = eager(h, index, w)
        (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).cos()).sum().backward()
        if r == rank:
            want = (y.detach(), h.grad, w.grad)
    h, index, w = inputs(rank)
    y = experts(h, index, w)
    (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y).cos()).sum().backward()
    out["output"] = (y - want[0]).abs().max().item()
    out["input"] = max((h.grad - want[1]).abs().max().item(), (w.grad - want[2]).abs().max().item())
    ref = {n: p.grad for n, p in eager.named_parameters()}
    errors = _expert_errors(experts, ref, rank)
    out["grad"], out["sharded"] = errors["grad"], errors["sharded"]
    return out


def two_processes(rank: int, world: int) -> dict[str, Any]:
    """Everything the 2-process launch runs (per rank: its results)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    out = {arch: guard(functools.partial(_family, arch, rank, world, mesh)) for arch in ARCHS}
    out["one-sided"] = guard(functools.partial(_one_sided, rank, world, mesh))
    out["twice"] = guard(functools.partial(_twice, mesh))
    return out


def _twice(mesh: Any) -> str:
    """Experts sharded, then sharded again through the model: refused."""
    model = hf_moe_cases.build("mixtral", aux=False)
    zeropipe.parallelize(hf_moe_cases.cut(model, 2), ep_mesh=mesh)
    try:
        zeropipe.parallelize(model, ep_mesh=mesh)
    except PipelineError as err:
        return str(err)
    return "accepted"


@functools.cache
def two_process_results() -> list[dict[str, Any]]:
    return zeropipe.launch(two_processes, 2, timeout=LAUNCH_TIMEOUT)


# -- pp 2 x dp 2, ep 2 inside dp ----------------------------------------------------------
PP, DP = 2, 2


def _pipeline(
    mesh: Any,
    name: str,
    ep: bool,
    overlap: bool = True,
    microbatches: int = hf_moe_cases.M,
    dp_shard: bool = False,
) -> tuple[nn.Module, zeropipe.Pipeline]:
    """Qwen3-MoE under schedule ``name`` ("1f1b+recompute": every forward recomputed
    before its backward, the experts' exchanges issued again)."""
    model = hf_moe_cases.build("qwen3_moe")
    chunks = 2 if name in ("zbv", "dualpipev") else 1
    stages = hf_moe_cases.cut(model, PP * chunks)
    if ep:
        zeropipe.parallelize(stages, ep_mesh=mesh["dp"])
    schedule: Any = name
    if name.endswith("+recompute"):
        base = zeropipe.build_schedule(name.split("+")[0], ranks=PP, microbatches=microbatches)
        schedule = checkpoint(base.compute_only())
    pipe = zeropipe.Pipeline(
        stages,
        schedule,
        loss_fn=zeropipe.causal_lm_loss,
        microbatches=microbatches,
        mesh=mesh,
        options=zeropipe.RuntimeOptions(timeout=60.0, overlap=overlap, dp_shard=dp_shard),
    )
    return model, pipe


def _ep_pipeline(mesh: Any, name: str, path: str | None) -> dict[str, Any]:
    """One step of this replica's half of the batch; clip_grad_norm_; a checkpoint."""
    ids, labels = hf_cases.batch(0, 8)
    reference = hf_moe_cases.build("qwen3_moe")
    ref_loss, ref = hf_moe_cases.reference(reference, ids, labels, m=DP * hf_moe_cases.M)
    model, pipe = _pipeline(mesh, name, ep=True)
    dp = mesh.get_local_rank("dp")
    half = torch.tensor_split(ids, DP)[dp], torch.tensor_split(labels, DP)[dp]
    loss = pipe.step(*half).item()
    out = _expert_errors(model, ref, dp, {id(p) for p in pipe.parameters()})
    out["loss"] = abs(loss - ref_loss)
    ref_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref.values()))
    out["norm"] = abs(pipe.clip_grad_norm_(1e-3).item() - ref_norm) / ref_norm
    if path is not None:
        zeropipe.save_checkpoint(pipe, None, path, model=model)
    return out


def _whole_errors(
    model: nn.Module, pipe: zeropipe.Pipeline, ref: dict[str, Tensor]
) -> dict[str, Any]:
    """Under dp_shard: this rank's gradients gathered whole (FSDP2's shards over "dp", the
    experts over "ep") against the reference's; and how each parameter is held: FSDP2's
    (Shard(0) over the replicas, its local rows fewer than the whole's) or an expert's."""
    mine = {id(p) for p in pipe.parameters()}
    grads = whole_grads(model)
    worst, checked, fsdp, experts = 0.0, 0, 0, {}
    for name, p in model.named_parameters():
        if id(p) not in mine or name not in grads:
            continue
        worst = max(worst, (grads[name] - ref[name]).abs().max().item())
        checked += 1
        if "experts" in name:
            experts[name] = [list(_local(p).shape), str(p.placements[0])]  # type: ignore[attr-defined]
        elif _local(p).shape != p.shape:
            fsdp += 1
    return {"grad": worst, "checked": checked, "fsdp": fsdp, "sharded": experts}


def _ep_dp_shard(mesh: Any) -> dict[str, Any]:
    """1f1b with dp_shard=True: the stages FSDP2-sharded over "dp" but for the experts,
    which stay whole on their ep rank; one step, then clip_grad_norm_."""
    ids, labels = hf_cases.batch(0, 8)
    ref_loss, ref = hf_moe_cases.reference(
        hf_moe_cases.build("qwen3_moe"), ids, labels, m=DP * hf_moe_cases.M
    )
    model, pipe = _pipeline(mesh, "1f1b", ep=True, dp_shard=True)
    dp = mesh.get_local_rank("dp")
    loss = pipe.step(torch.tensor_split(ids, DP)[dp], torch.tensor_split(labels, DP)[dp])
    out = _whole_errors(model, pipe, ref)
    out["loss"] = abs(loss.item() - ref_loss)
    ref_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref.values()))
    out["norm"] = abs(pipe.clip_grad_norm_(1e-3).item() - ref_norm) / ref_norm
    return out


OVERLAP_M = 6  # one row each: 7 overlapped pairs on each rank of dualpipev at pp 2


def _ep_overlap(mesh: Any) -> dict[str, Any]:
    """dualpipev, its pairs run at once and in sequence: the loss and this rank's gradients
    bitwise equal between the two, and the reference's; per pair of this rank's schedule,
    the time its halves shared and whether both stages hold sharded experts (layer 1 of
    the model is dense: rank 1's stage 1)."""
    batches = [hf_cases.batch(seed, 8) for seed in (0, 1)]  # 12 rows, 6 a replica
    ids, labels = (torch.cat(parts) for parts in zip(*batches, strict=True))
    dp = mesh.get_local_rank("dp")
    half = torch.tensor_split(ids, DP)[dp], torch.tensor_split(labels, DP)[dp]
    runs = []
    for overlap in (True, False):
        model, pipe = _pipeline(mesh, "dualpipev", True, overlap, OVERLAP_M)
        loss = pipe.step(*half)
        grads = [_local(p.grad).clone() for p in pipe.parameters() if p.grad is not None]
        runs.append((loss, grads, model, pipe))
    (loss, grads, model, pipe), (loss_off, grads_off, _, _) = runs
    ref_loss, ref = hf_moe_cases.reference(
        hf_moe_cases.build("qwen3_moe"), ids, labels, m=DP * OVERLAP_M
    )
    out = _expert_errors(model, ref, dp, {id(p) for p in pipe.parameters()})
    out["loss"] = abs(loss.item() - ref_loss)
    out["equal"] = bool(torch.equal(loss, loss_off)) and len(grads) == len(grads_off) > 0
    out["equal"] &= all(torch.equal(g, h) for g, h in zip(grads, grads_off, strict=True))
    rank = mesh.get_local_rank("pp")
    mine = {e.step: e for e in pipe.last_events[rank]}
    experts = {
        s
        for s, st in pipe.stages.items()
        if any("experts" in n for n, _ in st.module.named_parameters())
    }
    out["pairs"] = [
        (
            min(mine[k].end, mine[k + 1].end) - max(mine[k].start, mine[k + 1].start),
            {mine[k].action.stage, mine[k + 1].action.stage} <= experts,
        )
        for k in sorted(pipe.schedule.overlapped(rank))
    ]
    return out


def _load_at_ep1(mesh: Any, path: str) -> dict[str, Any]:
    """The checkpoint of the ep 2 pipeline loaded into plain experts (ep 1), same mesh."""
    model, pipe = _pipeline(mesh, "1f1b", ep=False)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    zeropipe.load_checkpoint(pipe, None, path, model=model)
    want = dict(hf_moe_cases.build("qwen3_moe").named_parameters())
    mine = {id(p) for p in pipe.parameters()}
    got = [(n, p) for n, p in model.named_parameters() if id(p) in mine]
    worst = max((p - want[n]).abs().max().item() for n, p in got)
    return {"value": worst, "checked": len(got), "experts": sum("experts" in n for n, _ in got)}


def _ep_below_dp(dp_shard: bool = False, own_mesh: bool = False) -> dict[str, Any]:
    """pp 1 x dp 4, the experts over blocks of 2 replicas (ep 2 < dp 4): expert gradients
    summed over the 2 replicas that hold the same experts, the others over all 4.  With
    ``dp_shard``, FSDP2 shards the others over the 4 and the experts over the "rep"
    dimension of their ep mesh (the replicas holding the same ones); ``own_mesh``: an ep
    mesh made from its block's group alone, which has no such dimension (the experts
    then stay whole, summed over those replicas)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", (1, 4), mesh_dim_names=("pp", "dp"))
    ep_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "ep"))["ep"]
    if own_mesh:
        block = [r for r in range(4) if r // 2 == dist.get_rank() // 2]
        ep_mesh = DeviceMesh.from_group(
            dist.new_group(block, use_local_synchronization=True), "cpu"
        )
    ids, labels = hf_cases.batch(0, 8)
    ref_loss, ref = hf_moe_cases.reference(hf_moe_cases.build("qwen3_moe", aux=False), ids, labels)
    model = hf_moe_cases.build("qwen3_moe", aux=False)
    stages = zeropipe.parallelize(hf_moe_cases.cut(model, 1), ep_mesh=ep_mesh)
    pipe = zeropipe.Pipeline(
        stages, "1f1b", loss_fn=zeropipe.causal_lm_loss, microbatches=1, mesh=mesh,
        options=zeropipe.RuntimeOptions(timeout=60.0, dp_shard=dp_shard),
    )  # fmt: skip
    dp = mesh.get_local_rank("dp")
    loss = pipe.step(torch.tensor_split(ids, 4)[dp], torch.tensor_split(labels, 4)[dp])
    if dp_shard:
        out = _whole_errors(model, pipe, ref)
    else:
        out = _expert_errors(model, ref, ep_mesh.get_local_rank())
    out["loss"] = abs(loss.item() - ref_loss)
    ref_norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref.values()))
    out["norm"] = abs(pipe.clip_grad_norm_(1e-3).item() - ref_norm) / ref_norm
    out["names"] = len(ref)
    return out


def four_processes(path: str, rank: int, world: int) -> dict[str, Any]:
    """Everything the 4-process launch runs (per rank: its results); the mesh is
    ("pp", "dp"): rank = pp * DP + dp."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    out: dict[str, Any] = {"pp": mesh.get_local_rank("pp"), "dp": mesh.get_local_rank("dp")}
    out["1f1b"] = guard(lambda: _ep_pipeline(mesh, "1f1b", path))
    out["zbv"] = guard(lambda: _ep_pipeline(mesh, "zbv", None))
    out["1f1b+recompute"] = guard(lambda: _ep_pipeline(mesh, "1f1b+recompute", None))
    out["load ep1"] = guard(lambda: _load_at_ep1(mesh, path))
    out["dualpipev overlap"] = guard(lambda: _ep_overlap(mesh))
    out["ep2 dp4"] = guard(_ep_below_dp)
    out["1f1b dp_shard"] = guard(lambda: _ep_dp_shard(mesh))
    out["ep2 dp4 dp_shard"] = guard(lambda: _ep_below_dp(dp_shard=True))
    out["ep2 dp4 dp_shard own mesh"] = guard(lambda: _ep_below_dp(dp_shard=True, own_mesh=True))
    return out


@functools.cache
def four_process_results(path: str) -> list[dict[str, Any]]:
    return zeropipe.launch(functools.partial(four_processes, path), PP * DP, timeout=LAUNCH_TIMEOUT)
