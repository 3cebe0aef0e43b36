"""What each rank runs in the context-parallel tests: cp 2 inside pp 2 (4 processes), and
cp 2 x tp 2 inside pp 2 (8 processes).

One launch per world size (``results`` / ``tp_results``, cached for the test session) runs
every case in turn inside the ranks: a small HF model built from a config (float64, no
dropout), cut by ``zeropipe.split``, sharded over ``mesh["cp"]`` by ``zeropipe.parallelize``,
two steps of a ``Pipeline`` over the mesh, each rank given the whole batch.  Each rank
returns each step's loss and, by parameter name, the whole gradient of the parameters its
stages own; the test process compares them with the unsplit model's
(tests/adapters/test_hf_cp.py).

The 4-process mesh is ("pp", "cp"): rank = pp * CP + cp; the 8-process one ("pp", "cp", "tp").
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

import zeropipe
from tests.adapters import hf_cases, tp_cases
from tests.gradcheck import whole_grads
from tests.runtime.dist_cases import guard
from zeropipe.core.errors import PipelineError, ScheduleError
from zeropipe.core.ir import Schedule
from zeropipe.core.passes.fit import checkpoint, offload
from zeropipe.core.schedules import GENERATORS

PP, CP, TP = 2, 2, 2
MICROBATCHES = 3  # hf_cases.batch has 6 rows
LAUNCH_TIMEOUT = 300.0
STEPS = ((0, 8), (1, 12))  # (step, sequence length): divisible by 2 x CP, changing
PACKED_SEQ = 12
FIRST = (5, 3, 7, 4, 9, 6)  # each packed row's first document's length


def generator_cases() -> dict[str, tuple[str, str, str, str]]:
    """name -> (arch, schedule, attention, batch): every generator on Llama, the other
    Llama-family models and sdpa attention under 1f1b, and packed rows under 1f1b and zbv."""
    cases = {
        f"llama {name}": ("llama", name, "eager", "plain")
        for name in sorted(GENERATORS)
        if name != "auto"
    }
    for arch in ("mistral", "qwen2", "qwen3"):
        cases[f"{arch} 1f1b"] = (arch, "1f1b", "eager", "plain")
    cases["llama 1f1b sdpa"] = ("llama", "1f1b", "sdpa", "plain")
    cases["llama zbv recompute ahead, offload"] = ("llama", "zbv+R+O", "eager", "plain")
    cases["mistral 1f1b window 5"] = ("mistral", "1f1b", "eager", "window")
    cases["llama 1f1b packed"] = ("llama", "1f1b", "eager", "packed")
    cases["qwen3 zbv packed"] = ("qwen3", "zbv", "sdpa", "packed")
    return cases


CASES = generator_cases()


def packed(seed: int) -> tuple[dict[str, Tensor], Tensor]:
    """Six rows of two documents each; position ids restart at the second; no document's
    first token is predicted from the one before it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (len(FIRST), PACKED_SEQ), generator=g)
    pos = torch.stack([torch.cat([torch.arange(n), torch.arange(PACKED_SEQ - n)]) for n in FIRST])
    labels = ids.clone()
    labels[pos == 0] = -100
    labels[2, -3:] = -100
    return {"input_ids": ids, "position_ids": pos}, labels


def build(arch: str, attn: str, kind: str) -> nn.Module:
    """``hf_cases``' model of ``arch``; for ``kind`` "window", a sliding window of 5 tokens
    (shorter than the sequences, so it masks)."""
    model = hf_cases.build(arch, tied=arch == "qwen3", attn=attn)
    if kind == "window":
        model.config.sliding_window = 5
    return model


def step_batch(kind: str, step: int, seq: int) -> tuple[Any, Tensor]:
    return packed(step) if kind == "packed" else hf_cases.batch(step, seq)


def reference(arch: str, attn: str, kind: str) -> list[tuple[float, dict[str, Tensor]]]:
    """The unsplit model's loss and gradients on the whole batch at each of ``STEPS``."""
    model = build(arch, attn, kind)
    out = []
    for step, seq in STEPS:
        inputs, labels = step_batch(kind, step, seq)
        model.zero_grad(set_to_none=True)
        given = inputs if isinstance(inputs, dict) else {"input_ids": inputs}
        loss = zeropipe.causal_lm_loss(model(**given, use_cache=False).logits, labels)
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return out


def _steps(model: nn.Module, pipe: zeropipe.Pipeline, kind: str) -> list[dict[str, Any]]:
    steps = []
    for step, seq in STEPS:
        model.zero_grad(set_to_none=True)
        loss = pipe.step(*step_batch(kind, step, seq))
        steps.append({"loss": loss.item(), "grads": whole_grads(model)})
    return steps


def _schedule(name: str, microbatches: int) -> Schedule:
    """``name`` built for ``PP`` ranks; ``zbv+R+O``: zbv with every forward recomputed
    ahead of its backward and its saved inputs offloaded (the recompute's gathers rerun)."""
    base, *rewrites = name.split("+")
    if not rewrites:
        return zeropipe.build_schedule(name, ranks=PP, microbatches=microbatches)
    return offload(checkpoint(zeropipe.generate(base, PP, microbatches), ahead=1))


def _pipeline(
    stages: list[nn.Module], schedule: Schedule | str, mesh: Any, *, dp_shard: bool = False
) -> zeropipe.Pipeline:
    """The pipeline every case runs: ``causal_lm_loss``, ``MICROBATCHES`` for a named
    schedule, a 60 s time limit."""
    return zeropipe.Pipeline(
        stages,
        schedule,
        loss_fn=zeropipe.causal_lm_loss,
        microbatches=MICROBATCHES if isinstance(schedule, str) else None,
        mesh=mesh,
        options=zeropipe.RuntimeOptions(timeout=60.0, dp_shard=dp_shard),
    )


def _case(mesh: Any, arch: str, name: str, attn: str, kind: str) -> dict[str, Any] | str:
    model = build(arch, attn, kind)
    try:
        schedule = _schedule(name, MICROBATCHES)
    except ScheduleError:
        try:  # dualpipe: an even count
            schedule = _schedule(name, 2)
        except ScheduleError as err:
            return f"skipped: {err}"
    n = schedule.num_stages - len(schedule.copies)  # DualPipe's copies run the originals
    stages = zeropipe.split(model, n, balance=[4 // n] * n)  # 4 decoder layers
    zeropipe.parallelize(stages, cp_mesh=mesh["cp"])
    pipe = _pipeline(stages, schedule, mesh)
    # every stage's input after the first holds the rank's tokens only
    shards = [getattr(st, "context_parallel", None) for st in stages]
    return {"steps": _steps(model, pipe, kind), "sharded": [s is not None for s in shards]}


def _dp_case(mesh: Any, dp_shard: bool = False) -> dict[str, Any]:
    """Llama under 1f1b on a ("pp", "dp", "cp") mesh of (1, 2, 2): one process plays both
    pipeline ranks, the two replicas each step on half the rows, the cp processes of a
    replica on its half's tokens; counts, loss and gradients summed over dp x cp (with
    ``dp_shard``, reduce-scattered into FSDP2's shards over dp x cp)."""
    model = hf_cases.build("llama", tied=False)
    stages = zeropipe.split(model, 2, balance=[2, 2])
    zeropipe.parallelize(stages, cp_mesh=mesh["cp"])
    schedule = zeropipe.build_schedule("1f1b", ranks=2, microbatches=1)
    pipe = _pipeline(stages, schedule, mesh, dp_shard=dp_shard)
    i, n = pipe.batch_slice  # the replica's slice, shared by its cp processes
    steps = []
    for step, seq in STEPS:
        model.zero_grad(set_to_none=True)
        ids, labels = hf_cases.batch(step, seq)
        loss = pipe.step(ids.tensor_split(n)[i], labels.tensor_split(n)[i])
        steps.append({"loss": loss.item(), "grads": whole_grads(model)})
    embedding = model.get_input_embeddings().weight
    held = getattr(embedding, "to_local", lambda: embedding)()
    # dp_shard: the rows this process holds of the 64 x 16 embedding (64 / (dp x cp))
    return {
        "steps": steps,
        "replicas": pipe.dp_size,
        "embedding": list(held.shape),
        "slice": [*pipe.batch_slice, mesh.get_local_rank("dp")],
    }


def _pp_cp_dp_shard(mesh: Any) -> dict[str, Any]:
    """Llama under 1f1b at pp 2 x cp 2 with dp_shard=True: each pipeline rank's stage
    sharded over its 2 cp processes (the replicas that sum its gradients)."""
    model = hf_cases.build("llama", tied=False)
    stages = zeropipe.split(model, PP, balance=[2, 2])
    zeropipe.parallelize(stages, cp_mesh=mesh["cp"])
    pipe = _pipeline(stages, "1f1b", mesh, dp_shard=True)
    held = [(list(p.to_local().shape), list(p.shape)) for p in pipe.parameters()]
    return {"steps": _steps(model, pipe, "plain"), "held": held}


def varlen_reference() -> tuple[float, dict[str, Tensor]]:
    """The unsplit Llama on ``hf_cases.varlen_batches``."""
    return hf_cases.varlen_reference(build("llama", "eager", "plain"))


def _varlen_case(mesh: Any) -> dict[str, Any]:
    """zbv over microbatches of different lengths, each sharded over cp on its own."""
    model = build("llama", "eager", "plain")
    stages = zeropipe.split(model, 4, balance=[1, 1, 1, 1])
    zeropipe.parallelize(stages, cp_mesh=mesh["cp"])
    return hf_cases.varlen_step(model, stages, mesh)


def _refused(make: Any) -> str:
    try:
        make()
    except PipelineError as err:
        return str(err)
    return "accepted"


def _refusals(mesh: Any) -> dict[str, str]:
    """A sequence 2 x cp does not divide; a loss that cannot take a shard; stages not
    sharded under a cp mesh; a mixture of experts; a whole model; stages sharded twice; a
    padding mask; sequence parallelism with cp."""
    from tests.adapters import hf_moe_cases

    def pipeline(stages: Any, loss: Any = zeropipe.causal_lm_loss) -> zeropipe.Pipeline:
        return zeropipe.Pipeline(stages, "1f1b", loss_fn=loss, microbatches=2, mesh=mesh)

    def odd_sequence() -> None:
        stages = zeropipe.split(hf_cases.build("llama", False), 2, balance=[2, 2])
        zeropipe.parallelize(stages, cp_mesh=mesh["cp"])
        pipeline(stages).step(*hf_cases.batch(0, 6))

    def sharded(loss: Any = zeropipe.causal_lm_loss) -> list[nn.Module]:
        stages = zeropipe.split(hf_cases.build("llama", False), 2, balance=[2, 2])
        zeropipe.parallelize(stages, cp_mesh=mesh["cp"])
        return stages

    llama = hf_cases.build("llama", False)
    ids, labels = hf_cases.batch(0, 8)
    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return {
        "odd sequence": _refused(odd_sequence),
        "loss": _refused(lambda: pipeline(sharded(), nn.CrossEntropyLoss())),
        "unsharded": _refused(lambda: pipeline(zeropipe.split(llama, 2, balance=[2, 2]))),
        "moe": _refused(
            lambda: zeropipe.parallelize(
                zeropipe.split(hf_moe_cases.build("qwen3_moe"), 2), cp_mesh=mesh["cp"]
            )
        ),
        "model": _refused(lambda: zeropipe.parallelize(llama, cp_mesh=mesh["cp"])),
        "twice": _refused(lambda: zeropipe.parallelize(sharded(), cp_mesh=mesh["cp"])),
        "padding": _refused(lambda: pipeline(sharded()).step(padded, labels)),
        "sequence parallel": _refused(
            lambda: zeropipe.parallelize(
                zeropipe.split(llama, 2), None, cp_mesh=mesh["cp"], sequence_parallel=True
            )
        ),
    }


def cases(rank: int, world: int) -> dict[str, Any]:
    """Everything the 4-process launch runs (per rank: its results)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (PP, CP), mesh_dim_names=("pp", "cp"))
    out: dict[str, Any] = {"pp": mesh.get_local_rank("pp"), "cp": mesh.get_local_rank("cp")}
    out["cases"] = {
        key: guard(functools.partial(_case, mesh, *case)) for key, case in CASES.items()
    }
    out["refusals"] = guard(lambda: _refusals(mesh))
    out["pp x cp dp_shard"] = guard(lambda: _pp_cp_dp_shard(mesh))
    out["microbatches"] = guard(lambda: _varlen_case(mesh))
    replicas = init_device_mesh("cpu", (1, 2, CP), mesh_dim_names=("pp", "dp", "cp"))
    out["dp x cp"] = guard(lambda: _dp_case(replicas))
    out["dp x cp dp_shard"] = guard(lambda: _dp_case(replicas, dp_shard=True))
    return out


def tp_case(rank: int, world: int) -> dict[str, Any]:
    """Qwen3 (4 heads, 2 key/value heads) under 1f1b at pp 2 x cp 2 x tp 2."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (PP, CP, TP), mesh_dim_names=("pp", "cp", "tp"))
    out: dict[str, Any] = {n: mesh.get_local_rank(n) for n in ("pp", "cp", "tp")}

    def run() -> list[dict[str, Any]]:
        model = tp_cases.build("qwen3", False)
        stages = zeropipe.split(model, PP, balance=[2, 2])
        zeropipe.parallelize(stages, mesh["tp"], cp_mesh=mesh["cp"])
        pipe = _pipeline(stages, "1f1b", mesh)
        return _steps(model, pipe, "plain")

    out["steps"] = guard(run)
    return out


def tp_reference() -> list[tuple[float, dict[str, Tensor]]]:
    model = tp_cases.build("qwen3", False)
    return [hf_cases.reference(model, *hf_cases.batch(step, seq)) for step, seq in STEPS]


@functools.cache
def results() -> list[dict[str, Any]]:
    """``cases`` on 4 processes, launched once per test session."""
    return zeropipe.launch(cases, PP * CP, timeout=LAUNCH_TIMEOUT)


@functools.cache
def tp_results() -> list[dict[str, Any]]:
    """``tp_case`` on 8 processes, launched once per test session."""
    return zeropipe.launch(tp_case, PP * CP * TP, timeout=LAUNCH_TIMEOUT)
