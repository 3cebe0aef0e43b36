"""What each rank runs in the Hugging Face tensor-parallel test: tp 2 inside pp 2 (4 processes).

One launch (``results``, cached for the test session) runs every case in turn inside
the ranks: a small HF model built from a config (float64, eager attention, no
dropout, 4 heads, 2 key/value heads), ``zeropipe.parallelize`` over ``mesh["tp"]``,
two steps of a ``Pipeline`` over ``mesh``.  Each rank returns the loss and, by
parameter name, the whole gradient (``full_tensor()`` of a DTensor's) of the
parameters its stages own, and what ``parallelize`` made of each parameter; the test
process compares them with the unsplit, unparallel model's (tests/adapters/test_hf_tp.py).
The mixtures of experts (``MOE_CASES``: Qwen3-MoE and Mixtral with their router's loss,
DeepSeek-V3's latent attention and shared experts; 2 heads, 2 key/value heads) run in the
same launch, and so do ``EP_CASE`` and ``EP_THEN_TP``: a (pp 1, dp 2, tp 2) mesh of the
same 4 processes, the experts sharded over the 2 replicas; each also returns
``clip_grad_norm_``'s norm.

The mesh is ("pp", "tp"): rank = pp * TP + tp.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

import zeropipe
from tests.adapters import hf_cases, hf_moe_cases
from tests.gradcheck import whole_grads
from tests.runtime.dist_cases import guard
from zeropipe.core.errors import PipelineError

PP, TP = 2, 2
WORLD = PP * TP
MICROBATCHES = 3  # hf_cases.batch has 6 rows
LAUNCH_TIMEOUT = 300.0
VOCAB = 64  # hf_cases.batch draws ids below 64

# name -> (arch, tied, schedule, order, sequence_parallel); order "stages": split, then
# parallelize the stages; "model": parallelize the model, then split it (measured cut).
CASES: dict[str, tuple[str, bool, str, str, bool]] = {
    "llama 1f1b": ("llama", False, "1f1b", "stages", False),
    "llama zbv model-first": ("llama", False, "zbv", "model", False),
    "qwen3 1f1b tied": ("qwen3", True, "1f1b", "stages", False),
    "qwen3 zbv tied": ("qwen3", True, "zbv", "stages", False),
    "qwen2 1f1b": ("qwen2", False, "1f1b", "stages", False),
    "llama 1f1b sp": ("llama", False, "1f1b", "stages", True),
    "qwen3 zbv sp model-first": ("qwen3", False, "zbv", "model", True),
}


def build(arch: str, tied: bool, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    """A 4-layer model of ``arch`` (hidden 32, head_dim 8), the same on every process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(
        arch,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
        attention_dropout=0.0,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64, attn_implementation="eager")


def reference(arch: str, tied: bool) -> list[tuple[float, dict[str, Tensor]]]:
    """The unsplit, unparallel model's loss and gradients at each of ``hf_cases.STEPS``."""
    model = build(arch, tied)
    return [hf_cases.reference(model, *hf_cases.batch(step, seq)) for step, seq in hf_cases.STEPS]


def layout(p: Tensor) -> str:
    """``"plain"`` or the DTensor's placements, e.g. ``"Shard(0)"``, ``"Replicate"``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return "plain"
    return ",".join(
        f"Shard({pl.dim})" if isinstance(pl, Shard) else
        "Replicate" if isinstance(pl, Replicate) else repr(pl)
        for pl in p.placements
    )  # fmt: skip


def _case(mesh: Any, arch: str, tied: bool, schedule: str, order: str, sp: bool) -> dict[str, Any]:
    model = build(arch, tied)
    chunks = 2 if schedule == "zbv" else 1
    if order == "model":
        zeropipe.parallelize(model, mesh["tp"], sequence_parallel=sp)
        stages = zeropipe.split(model, PP * chunks)  # cut by time measured on every rank
    else:
        stages = zeropipe.split(model, PP * chunks, balance=[1] * 4 if chunks == 2 else [2, 2])
        zeropipe.parallelize(stages, mesh["tp"], sequence_parallel=sp)
    return _steps(model, _pipeline(stages, schedule, mesh))


def _pipeline(stages: list[nn.Module], schedule: str, mesh: Any) -> zeropipe.Pipeline:
    return zeropipe.Pipeline(
        stages,
        schedule,
        loss_fn=zeropipe.causal_lm_loss,
        microbatches=MICROBATCHES,
        mesh=mesh,
        options=zeropipe.RuntimeOptions(timeout=60.0),
    )


def _steps(model: nn.Module, pipe: zeropipe.Pipeline, replicas: int = 1) -> dict[str, Any]:
    """``hf_cases.STEPS`` (each replica its slice of the batch): per step the loss, the whole
    gradients, which are DTensors and ``clip_grad_norm_``'s norm (nothing clipped); then
    what the plan made of each parameter."""
    steps = []
    for step, seq in hf_cases.STEPS:
        model.zero_grad(set_to_none=True)
        ids, labels = (t.tensor_split(replicas)[pipe.dp_rank] for t in hf_cases.batch(step, seq))
        loss = pipe.step(ids, labels)
        distributed = sorted(n for n, p in model.named_parameters() if layout(p.grad) != "plain")
        grads = whole_grads(model)
        norm = pipe.clip_grad_norm_(1e9).item()
        steps.append(
            {"loss": loss.item(), "grads": grads, "dtensor_grads": distributed, "norm": norm}
        )
    layouts = {name: layout(p) for name, p in model.named_parameters()}
    local = {name: list(p.to_local().shape) for name, p in model.named_parameters()
             if layout(p) != "plain"}  # fmt: skip
    return {"steps": steps, "layouts": layouts, "local_shapes": local}


# -- mixtures of experts: attention tensor-parallel, the sparse blocks replicated ------------
# name -> (arch, schedule): pp 2 x tp 2, split then parallelized; the router's loss on
# (Qwen3-MoE, Mixtral; DeepSeek-V3 has none): see tests/adapters/hf_moe_cases.py.
MOE_CASES: dict[str, tuple[str, str]] = {
    "qwen3_moe 1f1b": ("qwen3_moe", "1f1b"),
    "mixtral zbv": ("mixtral", "zbv"),
    "deepseek_v3 zbv": ("deepseek_v3", "zbv"),  # I and W apart, through MLA's hook
}
# pp 1 x dp 2 x tp 2, the experts sharded over the replicas (ep 2), 1f1b: one call of
# parallelize given both meshes; or expert parallelism first, then tensor parallelism
EP_CASE = "qwen3_moe pp1 x dp2 x tp2, ep2"
EP_THEN_TP = "qwen3_moe pp1 x dp2 x tp2, ep2 then tp"
EP_DP = 2


def moe_build(arch: str) -> nn.Module:
    """The tiny mixture of ``hf_moe_cases`` with 2 heads and 2 key/value heads (1 a rank)."""
    return hf_moe_cases.build(arch, kv_heads=2)


def moe_reference(arch: str, replicas: int = 1) -> list[tuple[float, dict[str, Tensor]]]:
    """The unsplit model microbatch by microbatch, the router's loss of each microbatch
    averaged over every replica's microbatches, at each of ``hf_cases.STEPS``."""
    model = moe_build(arch)
    return [
        hf_moe_cases.reference(model, *hf_cases.batch(step, seq), m=replicas * MICROBATCHES)
        for step, seq in hf_cases.STEPS
    ]


def _moe_case(mesh: Any, arch: str, schedule: str) -> dict[str, Any]:
    model = moe_build(arch)
    stages = hf_moe_cases.cut(model, PP * (2 if schedule == "zbv" else 1))
    zeropipe.parallelize(stages, mesh["tp"])
    return _steps(model, _pipeline(stages, schedule, mesh))


def _ep_case(apart: bool) -> dict[str, Any]:
    """tp 2 inside each of 2 replicas, the experts sharded over the replicas (ep = dp);
    ``apart``: by two calls, the experts first."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, EP_DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    model = moe_build("qwen3_moe")
    stages = hf_moe_cases.cut(model, 1)
    if apart:
        zeropipe.parallelize(stages, ep_mesh=mesh["dp"])
        zeropipe.parallelize(stages, mesh["tp"])
    else:
        zeropipe.parallelize(stages, mesh["tp"], ep_mesh=mesh["dp"])
    return _steps(model, _pipeline(stages, "1f1b", mesh), replicas=EP_DP)


def _twice(mesh: Any) -> None:
    model = build("qwen3", False)
    zeropipe.parallelize(zeropipe.split(model, 2, balance=[2, 2]), mesh["tp"])
    zeropipe.parallelize(model, mesh["tp"])


def _odd_sequence(mesh: Any) -> None:
    stages = zeropipe.split(build("llama", False), 2, balance=[2, 2])
    zeropipe.parallelize(stages, mesh["tp"], sequence_parallel=True)
    stages[0](torch.zeros(1, 5, dtype=torch.long))


def _refusals(mesh: Any) -> list[str]:
    """parallelize given the 2-D ("pp", "tp") mesh; 1 key/value head for 2 tp ranks; the
    model parallelized again after its stages were; 5 positions under sequence parallelism."""
    out = []
    for make in (
        lambda: zeropipe.parallelize(build("llama", False), mesh),
        lambda: zeropipe.parallelize(build("llama", False, heads=4, kv_heads=1), mesh["tp"]),
        lambda: _twice(mesh),
        lambda: _odd_sequence(mesh),
    ):
        try:
            make()
            out.append("accepted")
        except PipelineError as err:
            out.append(str(err))
    return out


def varlen_reference() -> tuple[float, dict[str, Tensor]]:
    """The unsplit Llama on ``hf_cases.varlen_batches``."""
    return hf_cases.varlen_reference(build("llama", False))


def _varlen_case(mesh: Any) -> dict[str, Any]:
    """zbv over microbatches of different lengths, the stages tensor-parallel."""
    model = build("llama", False)
    stages = zeropipe.split(model, PP * 2, balance=[1] * 4)
    zeropipe.parallelize(stages, mesh["tp"])
    return hf_cases.varlen_step(model, stages, mesh)


def cases(rank: int, world: int) -> dict[str, Any]:
    """Everything the 4-process launch runs (per rank: its results)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    out: dict[str, Any] = {"pp": mesh.get_local_rank("pp"), "tp": mesh.get_local_rank("tp")}
    out["cases"] = {
        key: guard(functools.partial(_case, mesh, *case)) for key, case in CASES.items()
    }
    out["cases"].update(
        {key: guard(functools.partial(_moe_case, mesh, *case)) for key, case in MOE_CASES.items()}
    )
    out["cases"][EP_CASE] = guard(lambda: _ep_case(apart=False))
    out["cases"][EP_THEN_TP] = guard(lambda: _ep_case(apart=True))
    out["refusals"] = guard(lambda: _refusals(mesh))
    out["microbatches"] = guard(lambda: _varlen_case(mesh))
    return out


@functools.cache
def results() -> list[dict[str, Any]]:
    """``cases`` on 4 processes, launched once per test session."""
    return zeropipe.launch(cases, WORLD, timeout=LAUNCH_TIMEOUT)
