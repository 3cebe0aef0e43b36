"""Model and accelerator specs, and what one pipeline stage costs on paper.

Planning a run before the cluster exists needs costs without a profile: this
module prices a decoder-only transformer stage from its shape
(:class:`~zeropipe.planning.pricing.transformer.ModelSpec`) and the accelerator's datasheet
figures (:class:`HardwareSpec`).  :func:`costs_from_spec` turns the figures into a cost
model (seconds and bytes).

The shipped specs are plain JSON beside this module (``spec_data/``); each
entry says where its numbers come from.  A model can also be read from a
Hugging Face ``config.json`` of a known decoder-only type
(:mod:`zeropipe.planning.hf_config`).

How a stage is priced (``T`` = tokens per microbatch = microbatch size x sequence):

* **Layers**: each transformer block, the embedding and the output head with the loss,
  from their FLOPs (at ``efficiency`` x the accelerator's dense peak for the dtype) and
  the bytes their memory-bound work moves (at ``memory_efficiency`` x the memory
  bandwidth), with flash or unfused attention and dropout, and what each keeps for
  backward: :mod:`zeropipe.planning.pricing.transformer`.  A stage sums its layers; a
  checkpointed stage (an R before its backward) keeps only its input.
* **Blocks checkpointed one by one** (``checkpoint_blocks``): each keeps its input and is
  rebuilt inside its backward, one at a time (:func:`~zeropipe.planning.pricing.transformer.checkpoint_blocks`);
  the embedding and the head are not checkpointed.
* **Static memory** per parameter: ``state_bytes`` (default 18: bf16 weight, fp32
  gradient, fp32 master copy and two Adam moments, as mixed-precision training
  without a sharded optimizer keeps them).
* **Copies to host** (offload, reload) at the ``host_bandwidth`` a pinned copy reaches.
* **Wires**: a pipeline hop inside a node uses the node's link (NVLink), across
  nodes the network; see :mod:`zeropipe.planning.pricing.links`.  Ranks are laid out
  tensor-parallel innermost, then data-parallel, then pipeline (a ``("pp", "dp",
  "tp")`` mesh), so a replica group of at most one node's GPUs reduces inside it.
* **Tensor parallelism** (``tp`` GPUs per block, optionally with sequence
  parallelism): what it divides, what it adds (two all-reduces of the activation
  per block forward, two backward) and the narrower matmuls' lower rate are in
  :mod:`zeropipe.planning.pricing.tensor_parallel`; every figure above is then one GPU's.
* **Mixtures of experts** and **expert parallelism** (``ep`` GPUs share the routed
  experts, inside the data-parallel replicas): compute by active weights, the
  all-to-alls of each MoE block on the links they cross, the experts' weights apart
  (their state and gradients per ``expert_state_bytes`` and reduced over ``dp / ep``
  replicas), the share of an overlapped pair hidden (``CostModel.overlap``):
  :mod:`zeropipe.planning.pricing.moe`.  Blocks of different kinds (dense first blocks)
  are cut into stages by their times (:func:`zeropipe.planning.balance.balance`).
* **Context parallelism** (``cp`` GPUs share each sequence, ring attention, placed after
  tp inside the node): :mod:`zeropipe.planning.pricing.context_parallel`.

Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.planning.catalog import (
    HardwareSpec,
    hardware_names,
    load_hardware,
    load_model,
    model_names,
)
from zeropipe.planning.pricing.context_parallel import check_cp, ring_steps
from zeropipe.planning.pricing.links import (
    pipeline_crosses_nodes,
    replicas_cross_nodes,
    ring_allreduce_latency,
)
from zeropipe.planning.pricing.moe import (
    all_to_all_time,
    block_kinds,
    check_ep,
    cut_by_time,
    pair_overlap,
    stage_blocks,
)
from zeropipe.planning.pricing.tensor_parallel import check_tp, matmul_share, ring_allreduce, split
from zeropipe.planning.pricing.transformer import (
    ATTENTION_KINDS,
    Kernels,
    LayerPrice,
    LayerRun,
    ModelSpec,
    checkpoint_blocks,
    price_embedding,
    price_head,
)

__all__ = [
    "HardwareSpec",
    "ModelSpec",
    "StagePrice",
    "costs_from_spec",
    "hardware_names",
    "load_hardware",
    "load_model",
    "model_names",
    "price_stages",
]

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}

DEFAULT_EFFICIENCY = 0.6  # share of the dense peak a large bf16 matmul reaches
DEFAULT_MEMORY_EFFICIENCY = 0.7  # share of the memory bandwidth elementwise kernels reach
DEFAULT_STATE_BYTES = 18.0  # bytes of weight, gradient and Adam state per parameter
DEFAULT_GRAD_BYTES = 4.0  # bytes per parameter a gradient all-reduce moves (fp32)


# -- pricing -------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePrice:
    """One stage's figures for one microbatch, in seconds and bytes (StageCost's fields),
    one GPU's (of the ``tp`` a tensor-parallel stage runs on: ``params`` is its share)."""

    F: float
    I: float
    W: float
    R: float
    act: float
    act_w: float
    ckpt: float
    weights: float
    grad_bytes: float
    boundary_bytes: float
    params: int
    blocks: int  # transformer blocks in this stage
    meta: dict[str, Any] = field(default_factory=dict)
    expert_params: int = 0  # this GPU's routed experts' weights (not in ``params``)
    all_to_all_f: float = 0.0  # of F, the MoE blocks' all-to-alls
    all_to_all_i: float = 0.0  # of I, the same
    workspace: float = 0.0  # a checkpointed block's activations, rebuilt for its backward


def _cut(layers: int, stages: int, block: float, first: float, last: float) -> list[int]:
    """Blocks per stage so the slowest stage is as fast as can be: the first stage also
    runs the embedding (``first`` extra time), the last the head and loss (``last``).

    Starts even and moves one block at a time from the slowest stage to the fastest
    while that lowers the slowest; ties keep the even cut's order."""
    base, extra = divmod(layers, stages)
    counts = [base + (1 if s < extra else 0) for s in range(stages)]
    extras = [0.0] * stages
    extras[0] += first
    extras[-1] += last

    def time(s: int) -> float:
        return counts[s] * block + extras[s]

    for _ in range(layers):
        slow = max(range(stages), key=time)
        fast = min(range(stages), key=time)
        if counts[slow] == 0 or (counts[fast] + 1) * block + extras[fast] >= time(slow):
            break
        counts[slow] -= 1
        counts[fast] += 1
    return counts


@dataclass(frozen=True)
class _PriceSettings:
    """How every stage is priced: what :func:`price_stages` takes besides the model, the
    accelerator, the stage count and the cut."""

    seq: int
    microbatch_size: int
    dtype: str
    efficiency: float
    memory_efficiency: float
    state_bytes: float
    grad_bytes: float
    attention: str
    dropout: bool
    tp: int
    sequence_parallel: bool
    tp_across_nodes: bool
    ep: int = 1
    cp: int = 1
    expert_state_bytes: float | None = None  # None: state_bytes
    expert_grad_bytes: float | None = None  # None: grad_bytes
    kernels: Kernels = field(default_factory=Kernels)  # attention's rate, float8, cp's ring
    checkpoint_blocks: bool = False  # each block keeps only its input (the module docstring)

    def check(self, model: ModelSpec, hardware: HardwareSpec, stages: int) -> None:
        """Refuse settings, or a stage count, that cannot price ``model`` on ``hardware``."""
        efficiencies = {"efficiency": self.efficiency, "memory_efficiency": self.memory_efficiency}
        for name, value in efficiencies.items():
            if not (0 < value <= 1):
                raise ScheduleError(f"{name} = {value!r} must be in (0, 1]")
        sizes = {"stages": stages, "seq": self.seq, "microbatch_size": self.microbatch_size}
        for name, ivalue in sizes.items():
            if not isinstance(ivalue, int) or isinstance(ivalue, bool) or ivalue < 1:
                raise ScheduleError(f"{name} = {ivalue!r} must be an int >= 1")
        if self.dtype not in _DTYPE_BYTES:
            raise ScheduleError(f"unknown dtype {self.dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
        if self.attention not in ATTENTION_KINDS:
            raise ScheduleError(
                f"attention = {self.attention!r}: give one of {', '.join(ATTENTION_KINDS)}"
            )
        if stages > model.layers + 2:
            raise ScheduleError(
                f"{stages} stages for a {model.layers}-layer model: at most layers + 2 "
                f"(a stage each for the embedding and the head); use fewer stages"
            )
        check_tp(
            self.tp,
            heads=model.heads,
            kv_heads=model.kv_heads,
            ffn=model.ffn,
            model=model.name,
            gpus_per_node=hardware.gpus_per_node,
            cross_node=self.tp_across_nodes,
        )
        check_ep(self.ep, model=model, dp=None, tp=self.tp)
        moe = model.experts > 0 or model.mla is not None
        check_cp(self.cp, seq=self.seq, attention=self.attention, moe=moe, name=model.name)
        if moe and self.kernels != Kernels():
            raise ScheduleError(f"{model.name}: kernels are priced for a dense model only")
        if model.is_moe and stages > model.layers:
            raise ScheduleError(
                f"{stages} stages for a {model.layers}-block mixture of experts: at most one "
                f"stage per block; use fewer stages"
            )

    def layer_run(self, model: ModelSpec, hardware: HardwareSpec) -> LayerRun:
        """The rates and the all-reduce every layer of a stage is priced at."""
        tp = self.tp
        t = self.microbatch_size * self.seq // self.cp  # one GPU's tokens
        e = _DTYPE_BYTES[self.dtype]
        link_far = tp > hardware.gpus_per_node
        ring = ring_steps(
            self.cp,
            tp,
            tokens=t,
            key_values=self.kernels.key_values(model),
            element_bytes=e,
            gpus_per_node=hardware.gpus_per_node,
            intra=(hardware.intra_bandwidth, hardware.intra_latency),
            inter=(hardware.inter_bandwidth, hardware.inter_latency),
            ring=self.kernels.ring,
            queries=(model.dim, model.heads),
        )
        return LayerRun(
            tokens=t,
            seq=self.seq,
            element_bytes=e,
            flop_rate=hardware.peak(self.dtype) * self.efficiency * matmul_share(model.hidden, tp),
            byte_rate=hardware.memory_bandwidth * self.memory_efficiency,
            allreduce=ring_allreduce(
                t * model.hidden * e,
                tp,
                hardware.inter_bandwidth if link_far else hardware.intra_bandwidth,
                hardware.inter_latency if link_far else hardware.intra_latency,
            ),
            tp=tp,
            sequence_parallel=self.sequence_parallel,
            **self._expert_run(model, hardware, model.hidden * e),
            **ring,
            **self.kernels.rates(hardware.peak(self.dtype)),
        )

    def _expert_run(self, model: ModelSpec, hardware: HardwareSpec, row: int) -> dict[str, Any]:
        """A mixture of experts' ``ep`` and the seconds of one dispatch of a microbatch's
        hidden states (``row`` bytes a token) to its experts (nothing for a dense model)."""
        if not model.is_moe:
            return {}
        seconds = all_to_all_time(
            float(row),
            self.microbatch_size * self.seq,
            model,
            self.ep,
            tp=self.tp,
            gpus_per_node=hardware.gpus_per_node,
            intra=(hardware.intra_bandwidth, hardware.intra_latency),
            inter=(hardware.inter_bandwidth, hardware.inter_latency),
        )
        return {"ep": self.ep, "all_to_all": seconds}

    def meta(self) -> dict[str, Any]:
        """The settings a cost model records (``sequence_parallel`` only where tp > 1)."""
        wider: dict[str, Any] = {n: v for n, v in (("ep", self.ep), ("cp", self.cp)) if v > 1}
        wider |= {"kernels": self.kernels.describe()} if self.kernels != Kernels() else {}
        wider |= {"checkpoint_blocks": True} if self.checkpoint_blocks else {}
        return {
            "seq": self.seq,
            "microbatch_size": self.microbatch_size,
            "dtype": self.dtype,
            "efficiency": self.efficiency,
            "memory_efficiency": self.memory_efficiency,
            "attention": self.attention,
            "dropout": self.dropout,
            "tp": self.tp,
            "sequence_parallel": self.sequence_parallel and self.tp > 1,
        } | wider


def price_stages(
    model: ModelSpec,
    hardware: HardwareSpec,
    *,
    stages: int,
    seq: int,
    microbatch_size: int = 1,
    dtype: str = "bf16",
    efficiency: float = DEFAULT_EFFICIENCY,
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY,
    state_bytes: float = DEFAULT_STATE_BYTES,
    grad_bytes: float = DEFAULT_GRAD_BYTES,
    blocks: list[int] | None = None,
    attention: str = "flash",
    dropout: bool = False,
    tp: int = 1,
    sequence_parallel: bool = True,
    tp_across_nodes: bool = False,
    ep: int = 1,
    cp: int = 1,
    kernels: Kernels | None = None,
    checkpoint_blocks: bool = False,
) -> list[StagePrice]:
    """Each stage's F, I, W, R times and memory for one microbatch (see the module docstring).

    ``blocks`` gives the transformer blocks of each stage (default: the cut whose
    slowest stage is fastest, see :func:`_cut`); the first stage also holds the embedding,
    the last the final norm, output head and loss.  ``attention`` is ``"flash"`` or
    ``"unfused"``; ``dropout`` prices the dropout layers of training.  ``tp``: each
    stage runs on ``tp`` GPUs, with ``sequence_parallel`` or not, inside a node unless
    ``tp_across_nodes`` (:mod:`zeropipe.planning.pricing.tensor_parallel`); figures are one GPU's.
    ``ep``: a mixture of experts' routed experts sharded over ep GPUs
    (:mod:`zeropipe.planning.pricing.moe`); ``cp``: each sequence over ``cp`` GPUs
    (:mod:`zeropipe.planning.pricing.context_parallel`); ``kernels``: :class:`Kernels`;
    ``checkpoint_blocks``: every block checkpointed on its own.
    """
    settings = _PriceSettings(
        seq=seq,
        microbatch_size=microbatch_size,
        dtype=dtype,
        efficiency=efficiency,
        memory_efficiency=memory_efficiency,
        state_bytes=state_bytes,
        grad_bytes=grad_bytes,
        attention=attention,
        dropout=dropout,
        tp=tp,
        sequence_parallel=sequence_parallel,
        tp_across_nodes=tp_across_nodes,
        ep=ep,
        cp=cp,
        kernels=kernels or Kernels(),
        checkpoint_blocks=checkpoint_blocks,
    )
    return _price(model, hardware, settings, stages, blocks)


def _price(
    model: ModelSpec,
    hardware: HardwareSpec,
    settings: _PriceSettings,
    stages: int,
    blocks: Sequence[int] | None,
) -> list[StagePrice]:
    """:func:`price_stages` with its settings gathered: check them, price each kind of
    layer once, cut the blocks into stages (``blocks``, or :func:`_cut`), sum each stage."""
    settings.check(model, hardware, stages)
    run = settings.layer_run(model, hardware)
    embedding, head = price_embedding(model, run), price_head(model, run)
    kinds = block_kinds(model, run, attention=settings.attention, dropout=settings.dropout)
    if blocks is not None:
        cut = list(blocks)
    elif len(kinds) == 1:
        cut = _cut(model.layers, stages, kinds[0][1].time, embedding.time, head.time)
    else:
        cut = cut_by_time(model, kinds, stages, embedding.time, head.time)
    if len(cut) != stages or sum(cut) != model.layers or min(cut) < 0:
        raise ScheduleError(
            f"blocks {cut} must give each of the {stages} stage(s) a count >= 0, "
            f"summing to the model's {model.layers} layers"
        )
    if model.tied_embeddings and stages == 1:  # the head's weights are the embedding's
        head = replace(head, params=model.hidden)
    starts = [sum(cut[:s]) for s in range(stages)]
    return [
        _stage_price(
            stage_blocks(model, kinds, starts[s], k),
            embedding=embedding if s == 0 else None,
            head=head if s == stages - 1 else None,
            run=run,
            hidden=model.hidden,
            settings=settings,
        )
        for s, k in enumerate(cut)
    ]


def _stage_price(
    parts: list[tuple[int, LayerPrice]],
    *,
    embedding: LayerPrice | None,
    head: LayerPrice | None,
    run: LayerRun,
    hidden: int,
    settings: _PriceSettings,
) -> StagePrice:
    """One stage: ``parts``' blocks (a count of each kind), after the ``embedding`` on the
    first stage, before the ``head`` on the last."""
    F, I, W = (sum(k * p.F for k, p in parts), sum(k * p.I for k, p in parts),
               sum(k * p.W for k, p in parts))  # fmt: skip
    act, act_w = sum(k * p.act for k, p in parts), sum(k * p.act_w for k, p in parts)
    a2a_f, a2a_i = (sum(k * p.all_to_all_f for k, p in parts),
                    sum(k * p.all_to_all_i for k, p in parts))  # fmt: skip
    t, e, tp, sp = run.tokens, run.element_bytes, run.tp, run.sequence_parallel
    block_input, workspace = split(t * hidden * e, 0.0, tp, sp), 0.0
    if settings.checkpoint_blocks:  # the blocks' forwards (all-to-alls too) again in I
        recomputed, act, workspace = checkpoint_blocks(parts, block_input)
        I, a2a_i = I + recomputed, a2a_i + a2a_f
    params = sum(k * p.params for k, p in parts)
    experts = sum(k * p.expert_params for k, p in parts)
    if embedding is not None:
        params += embedding.params
        F += embedding.F
        W += embedding.W
    if head is not None:
        F, I, W = F + head.F, I + head.I, W + head.W
        act, act_w = act + head.act, act_w + head.act_w
        params += head.params
    ckpt = float(block_input if embedding is None else t * 8)  # what R keeps (or token ids)
    weights, grads = params * settings.state_bytes, params * settings.grad_bytes
    if experts:
        weights += experts * _or(settings.expert_state_bytes, settings.state_bytes)
        grads += experts * _or(settings.expert_grad_bytes, settings.grad_bytes)
    return StagePrice(
        F=F,
        I=I,
        W=W,
        R=F,
        act=act,
        act_w=act_w,
        ckpt=ckpt,
        weights=weights,
        grad_bytes=grads,
        boundary_bytes=float(t * hidden * e / tp),
        params=params,
        blocks=sum(k for k, _ in parts),
        expert_params=experts,
        all_to_all_f=a2a_f,
        all_to_all_i=a2a_i,
        workspace=workspace,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def costs_from_spec(
    model: ModelSpec | str,
    hardware: HardwareSpec | str,
    *,
    stages: int,
    seq: int,
    microbatch_size: int = 1,
    dtype: str = "bf16",
    efficiency: float | None = None,
    memory_efficiency: float | None = None,
    recompute: bool = False,
    pp: int | None = None,
    dp: int = 1,
    state_bytes: float = DEFAULT_STATE_BYTES,
    grad_bytes: float = DEFAULT_GRAD_BYTES,
    blocks: Sequence[int] | None = None,
    attention: str = "flash",
    dropout: bool = False,
    tp: int = 1,
    sequence_parallel: bool = True,
    tp_across_nodes: bool = False,
    ep: int = 1,
    expert_state_bytes: float | None = None,
    cp: int = 1,
    kernels: Kernels | None = None,
    checkpoint_blocks: bool = False,
) -> CostModel:
    """Price a decoder-only transformer on an accelerator from their specs (no profile).

    ``model`` and ``hardware`` are specs or names (:func:`load_model` also takes a Hugging Face
    ``config.json``).  The model is cut into ``stages`` (``blocks``: transformer blocks per
    stage; default even) run by ``pp`` ranks (default ``stages``; zbv's ``2p`` stages run on
    ``p``), with ``dp`` replicas, each sequence over ``cp`` GPUs (gradients reduced over ``dp x
    cp``).  Times are seconds, memory bytes (``unit="bytes"``), as this module's docstring
    says; ``attention``, ``dropout``, ``kernels`` and ``checkpoint_blocks``: how the blocks run
    (:func:`price_stages`).  Each stage runs on ``tp`` GPUs (with ``sequence_parallel`` or not;
    inside a node unless ``tp_across_nodes``), every figure one GPU's.  ``recompute`` makes R
    and ``ckpt`` available for :func:`zeropipe.core.passes.fit.checkpoint` (it checkpoints
    nothing itself).  ``meta``: the inputs, and ``flops_per_microbatch`` / ``peak_flops`` for
    MFU.  Routed experts: sharded over ``ep`` of the ``dp`` replicas, ``expert_state_bytes`` a
    weight (default ``state_bytes``), gradients reduced over ``dp / ep`` replicas.
    """
    m = load_model(model) if isinstance(model, str) else model
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    _check_dp(dp, ep, m, tp)
    settings = _PriceSettings(
        seq=seq,
        microbatch_size=microbatch_size,
        dtype=dtype,
        efficiency=_or(efficiency, DEFAULT_EFFICIENCY),
        memory_efficiency=_or(memory_efficiency, DEFAULT_MEMORY_EFFICIENCY),
        state_bytes=state_bytes,
        grad_bytes=grad_bytes,
        attention=attention,
        dropout=dropout,
        tp=tp,
        sequence_parallel=sequence_parallel,
        tp_across_nodes=tp_across_nodes,
        ep=ep,
        cp=cp,
        expert_state_bytes=expert_state_bytes,
        expert_grad_bytes=_expert_reduce(grad_bytes, dp, ep),
        kernels=kernels or Kernels(),
        checkpoint_blocks=checkpoint_blocks,
    )
    priced = _price(m, hw, settings, stages, blocks)
    group = dp * cp  # the ranks holding a stage: cp inside dp
    far = pipeline_crosses_nodes(stages if pp is None else pp, group, hw.gpus_per_node, tp)
    dp_far = replicas_cross_nodes(group, hw.gpus_per_node, tp)
    return CostModel(
        tuple(_stage_cost(p, hw.host_bandwidth, recompute) for p in priced),
        latency=hw.inter_latency if far else hw.intra_latency,
        bandwidth=hw.inter_bandwidth if far else hw.intra_bandwidth,
        unit="bytes",
        dp=group,
        dp_latency=ring_allreduce_latency(group, hw.inter_latency if dp_far else hw.intra_latency),
        dp_bandwidth=hw.inter_bandwidth if dp_far else hw.intra_bandwidth,
        meta=_spec_meta(m, hw, settings, priced, pipeline_far=far, replicas_far=dp_far),
        overlap=pair_overlap(priced) if m.is_moe else 0.0,
    )


def _check_dp(dp: int, ep: int, model: ModelSpec, tp: int) -> None:
    """Refuse a data-parallel degree below 1, or an ep the model or dp cannot take."""
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ScheduleError(f"dp = {dp!r} must be a whole number >= 1")
    check_ep(ep, model=model, dp=dp, tp=tp)


def _expert_reduce(grad_bytes: float, dp: int, ep: int) -> float:
    """Bytes per routed-expert weight that, reduced over the ``dp`` replicas as the cost model
    prices it (``2 (dp - 1) / dp`` of them), take as long as ``grad_bytes`` reduced over the
    ``dp / ep`` replicas holding the same experts."""
    replicas = dp // ep
    if dp == 1 or replicas == 1:
        return 0.0
    return grad_bytes * ((replicas - 1) / replicas) / ((dp - 1) / dp)


def _stage_cost(price: StagePrice, host_bandwidth: float, recompute: bool) -> StageCost:
    """A priced stage as the cost model holds it: host copies at ``host_bandwidth``
    (bytes/s), ``ckpt`` only where recomputation may be planned."""
    return StageCost(
        F=price.F,
        I=price.I,
        W=price.W,
        R=price.R,
        act=price.act,
        act_w=price.act_w,
        ckpt=price.ckpt if recompute else 0.0,
        weights=price.weights,
        grad_bytes=price.grad_bytes,
        boundary_bytes=price.boundary_bytes,
        OFFLOAD=price.act / host_bandwidth,
        RELOAD=price.act / host_bandwidth,
        weight_copy=price.weights / host_bandwidth,
        workspace=price.workspace,
    )


def _spec_meta(
    model: ModelSpec,
    hardware: HardwareSpec,
    settings: _PriceSettings,
    priced: list[StagePrice],
    *,
    pipeline_far: bool,
    replicas_far: bool,
) -> dict[str, Any]:
    """What a spec cost model records: its inputs, the cut, the links it prices and the
    figures MFU needs."""
    tokens = settings.microbatch_size * settings.seq // settings.cp  # one GPU's
    return {
        "source": "spec",
        "time_unit": "s",
        "model": model.name,
        "hardware": hardware.name,
        "params": model.params(),
        **settings.meta(),
        "blocks": [p.blocks for p in priced],
        "pipeline_link": "network" if pipeline_far else "node",
        "replica_link": "network" if replicas_far else "node",
        "flops_per_microbatch": model.flops_per_token(settings.seq) * tokens,
        "peak_flops": hardware.peak(settings.dtype),
    }
