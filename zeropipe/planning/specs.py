"""Model and accelerator specs, and what one pipeline stage costs on paper.

Planning a run before the cluster exists needs costs without a profile: this
module prices a decoder-only transformer stage from its shape and the
accelerator's datasheet figures.  :func:`costs_from_spec`
turns the figures into a cost model (seconds and bytes).

The shipped specs are plain JSON beside this module (``spec_data/``); each
entry says where its numbers come from.  A model can also be read from a
Hugging Face ``config.json`` of a known decoder-only type
(:mod:`zeropipe.planning.hf_config`).

How a stage is priced (``T`` = tokens per microbatch = microbatch size x sequence):

* **Compute** (at ``efficiency`` x the accelerator's dense peak for the dtype):
  every linear costs ``2 T n`` FLOPs forward for ``n`` weights, the same again for the
  input gradient (I) and for the weight gradient (W).  Causal attention (flash
  style, masked blocks skipped) costs ``2 T s d`` forward for ``d`` = heads x head
  dim and a sequence of ``s``, 2.5 times that backward, all of it in I (attention
  has no weights).
* **Memory-bound work** (norms, rotary embedding, residual adds, the activation
  function; at ``memory_efficiency`` x the memory bandwidth): the bytes each reads
  and writes, twice that backward (in I).  The loss reads and writes the logits in
  float32.
* **Unfused attention** (``attention="unfused"``, as Megatron-LM runs without
  ``--use-flash-attn``): the full ``s x s`` score matrix of every head is computed
  (``4 T s d`` FLOPs forward, twice that backward) and passes through memory: written
  by the score product, read and written by the softmax, read by the value product;
  backward, the gradient of the probabilities is written, the softmax backward reads
  it and the probabilities and writes the scores' gradient, which the two products
  read, and the value product's gradient reads the probabilities again.  The
  probabilities are kept for backward.
* **Dropout** (``dropout=True``): on the attention probabilities (unfused attention
  only: a flash kernel draws its mask inside) one more read and write each way and a
  one-byte mask, kept for backward; after the attention and the FFN, a one-byte mask
  on ``T h`` written forward, read backward and kept.
* **Activation memory** per layer and microbatch, ``dtype`` bytes per element: what
  backward needs, ``T (6 h + 2 kv + 3 f)`` elements for a gated FFN (``2 f`` for a
  plain one), ``h`` = hidden, ``kv`` = key/value width, ``f`` = FFN width, and what
  unfused attention and dropout add (above).  Of it, W still needs the linears'
  inputs and the gradients of their outputs (``act_w``).
  A checkpointed stage keeps only its input.
* **Static memory** per parameter: ``state_bytes`` (default 18: bf16 weight, fp32
  gradient, fp32 master copy and two Adam moments, as mixed-precision training
  without a sharded optimizer keeps them).
* **Copies to host** (offload, reload) at the ``host_bandwidth`` a pinned copy reaches.
* **Wires**: a pipeline hop inside a node uses the node's link (NVLink), across
  nodes the network; see :func:`pipeline_crosses_nodes`.  Ranks are laid out
  tensor-parallel innermost, then data-parallel, then pipeline (a ``("pp", "dp",
  "tp")`` mesh), so a replica group of at most one node's GPUs reduces inside it.
* **Tensor parallelism** (``tp`` GPUs per block, optionally with sequence
  parallelism): what it divides, what it adds (two all-reduces of the activation
  per block forward, two backward) and the narrower matmuls' lower rate are in
  :mod:`zeropipe.planning.tensor_parallel`; every figure above is then one GPU's.

Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any

from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ScheduleError
from zeropipe.planning.hf_config import read_hf_config, spec_fields
from zeropipe.planning.tensor_parallel import (
    check_tp,
    kv_split,
    matmul_share,
    ring_allreduce,
    split,
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
    "pipeline_crosses_nodes",
    "price_stages",
    "replicas_cross_nodes",
    "ring_allreduce_latency",
]

_DATA = Path(__file__).with_name("spec_data")
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 1}

DEFAULT_EFFICIENCY = 0.6  # share of the dense peak a large bf16 matmul reaches
DEFAULT_MEMORY_EFFICIENCY = 0.7  # share of the memory bandwidth elementwise kernels reach
DEFAULT_STATE_BYTES = 18.0  # bytes of weight, gradient and Adam state per parameter
DEFAULT_GRAD_BYTES = 4.0  # bytes per parameter a gradient all-reduce moves (fp32)
ATTENTION_KINDS = ("flash", "unfused")  # how attention is computed (see the docstring)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    gated: bool = True  # SwiGLU-style FFN (gate, up, down) or a plain two-matrix one
    head_dim: int | None = None  # None: hidden / heads
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"model {self.name!r}: {name} = {value!r} must be an int >= 1")
        if self.heads % self.kv_heads:
            raise ScheduleError(
                f"model {self.name!r}: heads ({self.heads}) must be a multiple of "
                f"kv_heads ({self.kv_heads})"
            )
        if self.head_dim is None and self.hidden % self.heads:
            raise ScheduleError(
                f"model {self.name!r}: hidden ({self.hidden}) is not a multiple of heads "
                f"({self.heads}); give head_dim"
            )

    @property
    def dim(self) -> int:
        """Width of the attention heads together (``heads x head_dim``)."""
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    def layer_params(self) -> int:
        """Weights of one transformer block (norm weights included)."""
        attention = self.hidden * (self.dim + 2 * self.kv_dim) + self.dim * self.hidden
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn
        return attention + mlp + 2 * self.hidden

    def params(self) -> int:
        """All weights: embedding, blocks, final norm and (unless tied) the output head."""
        embedding = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else embedding
        return embedding + self.layers * self.layer_params() + self.hidden + head

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token by the usual convention for MFU: ``6 N + 12 L d s``.

        ``N`` counts every weight a token is multiplied by (blocks and output head,
        not the embedding lookup); ``12 L d s`` is attention's score and value
        products forward and backward without skipping the causal mask.  No
        recomputation is counted: MFU counts the model's work, not the plan's.
        """
        matmul = self.layers * self.layer_params() + self.vocab * self.hidden
        return 6.0 * matmul + 12.0 * self.layers * self.dim * seq

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "") -> ModelSpec:
        """Read a Hugging Face ``config.json``'s contents (a known decoder-only type:
        :data:`zeropipe.planning.hf_config.DECODER_TYPES`); anything else is refused."""
        return cls(**spec_fields(config, where=f"config of model {name!r}", name=name))


@dataclass(frozen=True)
class HardwareSpec:
    """An accelerator and the links around it (bandwidths per GPU, one direction)."""

    name: str
    flops: dict[str, float]  # dtype -> dense peak FLOP/s
    memory: float  # bytes
    memory_bandwidth: float  # bytes/s
    gpus_per_node: int
    intra_bandwidth: float  # bytes/s between two GPUs of a node
    intra_latency: float  # seconds per message inside a node
    inter_bandwidth: float  # bytes/s of one GPU's share of the network
    inter_latency: float  # seconds per message across nodes
    host_bandwidth: float = 25e9  # bytes/s of a pinned copy to or from host memory
    source: str = ""

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ScheduleError(
                f"{self.name} has no peak given for dtype {dtype!r}; known: "
                f"{', '.join(sorted(self.flops))}"
            )
        return self.flops[dtype]


def _read(kind: str) -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = json.loads((_DATA / f"{kind}.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


@cache
def _shipped(kind: str) -> dict[str, dict[str, Any]]:
    return _read(kind)


def model_names() -> list[str]:
    return sorted(_shipped("models"))


def hardware_names() -> list[str]:
    return sorted(_shipped("hardware"))


def load_model(name_or_path: str) -> ModelSpec:
    """A shipped model by name, or a Hugging Face ``config.json`` (a file or its folder)."""
    shipped = _shipped("models")
    if name_or_path.lower() in shipped:
        entry = shipped[name_or_path.lower()]
        return ModelSpec(name=name_or_path.lower(), **entry)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ScheduleError(
            f"unknown model {name_or_path!r}: give a Hugging Face config.json (file or folder) "
            f"or one of {', '.join(model_names())}"
        )
    shape = read_hf_config(path)
    try:
        return ModelSpec(**shape)
    except ScheduleError as exc:  # a shape that cannot be (heads and kv_heads, ...)
        raise ScheduleError(f"{path}: {exc}") from None


def load_hardware(name: str) -> HardwareSpec:
    shipped = _shipped("hardware")
    entry = shipped.get(name.lower())
    if entry is None:
        raise ScheduleError(f"unknown GPU {name!r}; known: {', '.join(hardware_names())}")
    known = {f.name for f in fields(HardwareSpec)}
    return HardwareSpec(name=name.lower(), **{k: v for k, v in entry.items() if k in known})


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
) -> list[StagePrice]:
    """Each stage's F, I, W, R times and memory for one microbatch (see the module docstring).

    ``blocks`` gives the transformer blocks of each stage (default: the cut whose
    slowest stage is fastest, see :func:`_cut`); the first stage also holds the embedding,
    the last the final norm, output head and loss.  ``attention`` is ``"flash"`` or
    ``"unfused"``; ``dropout`` prices the dropout layers of training.  ``tp``: each
    stage runs on ``tp`` GPUs, with ``sequence_parallel`` or not, inside a node unless
    ``tp_across_nodes`` (:mod:`zeropipe.planning.tensor_parallel`); figures are one GPU's.
    """
    for name, value in (("efficiency", efficiency), ("memory_efficiency", memory_efficiency)):
        if not (0 < value <= 1):
            raise ScheduleError(f"{name} = {value!r} must be in (0, 1]")
    for name, ivalue in (("stages", stages), ("seq", seq), ("microbatch_size", microbatch_size)):
        if not isinstance(ivalue, int) or isinstance(ivalue, bool) or ivalue < 1:
            raise ScheduleError(f"{name} = {ivalue!r} must be an int >= 1")
    if dtype not in _DTYPE_BYTES:
        raise ScheduleError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}")
    if attention not in ATTENTION_KINDS:
        raise ScheduleError(f"attention = {attention!r}: give one of {', '.join(ATTENTION_KINDS)}")
    if stages > model.layers + 2:
        raise ScheduleError(
            f"{stages} stages for a {model.layers}-layer model: at most layers + 2 "
            f"(a stage each for the embedding and the head); use fewer stages"
        )
    check_tp(tp, heads=model.heads, kv_heads=model.kv_heads, ffn=model.ffn, model=model.name,
             gpus_per_node=hardware.gpus_per_node, cross_node=tp_across_nodes)  # fmt: skip
    sp = sequence_parallel
    flop = hardware.peak(dtype) * efficiency * matmul_share(model.hidden, tp)  # FLOP/s reached
    mem = hardware.memory_bandwidth * memory_efficiency  # bytes/s reached
    e = _DTYPE_BYTES[dtype]
    t = microbatch_size * seq  # tokens
    h, kv, f, d = model.hidden, model.kv_dim, model.ffn, model.dim
    # Key/value heads fewer than tp are copied: as if kv_t wide, cut tp ways.
    kv_t = kv * tp // kv_split(model.kv_heads, tp)
    n = model.layer_params() - 2 * h + 2 * h * (kv_t - kv)  # weights in linears, over tp GPUs
    ffn_mats = 3 if model.gated else 2
    ffn_act = 3 * f if model.gated else 2 * f

    # One block.  Linears: 2 t n FLOPs each for F, I and W.  Flash attention: 2 t s d
    # forward (causal: half of the 4 t s d of a full square), 2.5x backward.
    # Elementwise bytes forward: two norms (read + write h each) and two residual adds
    # (read 2, write 1) outside the tensor-parallel region; rotary on q and k and the
    # activation (gated: read 2 f, write f) inside it; backward twice that.
    ew_out, ew_in = t * e * 10.0 * h, t * e * (2.0 * (d + kv_t) + ffn_act)
    ew_out_i, ew_in_i = 2 * ew_out, 2 * ew_in
    # Saved for backward: norm inputs and outputs (4 h) outside; q k v (d + 2 kv),
    # attention output (h-wide), FFN gate/up/product (3 f) or pre/post activation (2 f).
    act_out, act_in = t * e * 4.0 * h, t * e * (h + d + 2.0 * kv_t + ffn_act)
    if attention == "flash":
        attention_f, attention_i = 2.0 * t * seq * d, 5.0 * t * seq * d
    else:  # the full square; the score matrices' passes through memory (docstring)
        attention_f, attention_i = 4.0 * t * seq * d, 8.0 * t * seq * d
        scores = t * seq * model.heads  # elements of one microbatch's score matrices
        drop = 1 if dropout else 0  # dropout on the probabilities: 2 passes and a mask
        ew_in += scores * ((4 + 2 * drop) * e + drop)
        ew_in_i += scores * ((7 + 2 * drop) * e + drop)
        act_in += scores * ((1 + drop) * e + drop)
    if dropout:  # masks after the attention and the FFN: written, read back, kept
        ew_out += 2 * t * h
        ew_out_i += 2 * t * h
        act_out += 2 * t * h
    elementwise_f = split(ew_out, ew_in, tp, sp)
    elementwise_i = split(ew_out_i, ew_in_i, tp, sp)
    block_act = split(act_out, act_in, tp, sp)
    link_far = tp > hardware.gpus_per_node
    allreduce = ring_allreduce(
        t * h * e, tp,
        hardware.inter_bandwidth if link_far else hardware.intra_bandwidth,
        hardware.inter_latency if link_far else hardware.intra_latency,
    )  # fmt: skip
    block_f = (2.0 * t * n + attention_f) / tp / flop + elementwise_f / mem + 2 * allreduce
    block_i = (2.0 * t * n + attention_i) / tp / flop + elementwise_i / mem + 2 * allreduce
    block_w = 2.0 * t * n / tp / flop
    # W needs each linear's input and its output's gradient: the h-wide ones outside.
    linear_in_out = d + f + (d + 2 * kv_t) + (ffn_mats - 1) * f  # inside; 4 h outside
    block_act_w = min(block_act, split(t * e * 4.0 * h, t * e * linear_in_out, tp, sp))

    head_n = model.vocab * h  # vocabulary-parallel: cut tp ways, like the logits
    head_f = (2.0 * t * head_n / flop + t * model.vocab * 4 * 2 / mem) / tp  # + fp32 loss
    head_i = (2.0 * t * head_n / flop + t * model.vocab * 4 * 3 / mem) / tp + allreduce
    head_w = 2.0 * t * head_n / tp / flop
    head_act = split(t * e * h, t * 4.0 * model.vocab, tp, sp)  # input, fp32 logits

    embed_time = split(t * h * e * 3, 0.0, tp, sp) / mem  # the lookup, the scatter-add in W
    block_time = block_f + block_i + block_w
    head_time = head_f + head_i + head_w
    if blocks is None:
        cut = _cut(model.layers, stages, block_time, embed_time + allreduce, head_time)
    else:
        cut = list(blocks)
    if len(cut) != stages or sum(cut) != model.layers or min(cut) < 0:
        raise ScheduleError(
            f"blocks {cut} must give each of the {stages} stage(s) a count >= 0, "
            f"summing to the model's {model.layers} layers"
        )

    layer_params = n // tp + 2 * h  # one GPU's: its slice of the linears, the norms whole
    out: list[StagePrice] = []
    for s, k in enumerate(cut):
        first, last = s == 0, s == stages - 1
        F, I, W = k * block_f, k * block_i, k * block_w
        act, act_w, params = k * block_act, k * block_act_w, k * layer_params
        if first:
            params += model.vocab * h // tp  # embedding: a lookup forward, a scatter-add in W
            F += embed_time / 3 + allreduce
            W += embed_time * 2 / 3
        if last:
            F, I, W = F + head_f, I + head_i, W + head_w
            act, act_w = act + head_act, act_w + split(t * e * h, 0.0, tp, sp)
            params += h + (0 if model.tied_embeddings and stages == 1 else head_n // tp)
        ckpt = float(split(t * h * e, 0.0, tp, sp) if not first else t * 8)  # its input
        out.append(
            StagePrice(
                F=F, I=I, W=W, R=F, act=act, act_w=act_w, ckpt=ckpt,
                weights=params * state_bytes, grad_bytes=params * grad_bytes,
                boundary_bytes=float(t * h * e / tp), params=params, blocks=k,
            )
        )  # fmt: skip
    return out


def pipeline_crosses_nodes(pp: int, dp: int, gpus_per_node: int, tp: int = 1) -> bool:
    """Whether some pipeline hop leaves its node, ranks laid out tensor-parallel
    innermost, then data-parallel (rank = (pipeline index x dp + replica) x tp + tp
    index), as a DeviceMesh ("pp", "dp", "tp") lays them out.  Any crossing hop prices
    every hop on the network: the slow hop holds the pipeline back."""
    return pp > 1 and pp * dp * tp > gpus_per_node


def replicas_cross_nodes(dp: int, gpus_per_node: int, tp: int = 1) -> bool:
    """Whether a data-parallel group spans nodes (its ranks are ``tp`` apart, ``dp x tp``
    contiguous ranks hold it: see above)."""
    return dp * tp > gpus_per_node or gpus_per_node % (dp * tp) != 0


def ring_allreduce_latency(dp: int, latency: float) -> float:
    """A ring all-reduce's fixed cost: ``2 (dp - 1)`` messages in sequence."""
    return 2 * (dp - 1) * latency if dp > 1 else 0.0


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
) -> CostModel:
    """Price a decoder-only transformer on an accelerator from their specs (no profile).

    ``model`` and ``hardware`` are specs or names (:func:`zeropipe.planning.specs.load_model`
    also takes a Hugging Face ``config.json``).  The model is cut into ``stages``
    (``blocks``: transformer blocks per stage; default even) run by ``pp`` ranks
    (default ``stages``; zbv's ``2p`` stages run on ``p``), with ``dp`` replicas.
    Times are seconds, memory bytes (``unit="bytes"``); how each figure is
    derived is in :mod:`zeropipe.planning.specs`; ``attention`` (``"flash"`` or ``"unfused"``)
    and ``dropout`` say how the blocks run.  Each stage runs on ``tp`` GPUs (tensor
    parallel, with ``sequence_parallel`` or not; inside a node unless ``tp_across_nodes``:
    :mod:`zeropipe.planning.tensor_parallel`), and every figure is one GPU's; tp = 1 is
    plain pipeline and data parallelism.  ``recompute`` makes R and ``ckpt``
    available for :func:`zeropipe.core.passes.fit.checkpoint`; it does not itself
    checkpoint anything.  ``meta`` records the inputs and
    ``flops_per_microbatch`` / ``peak_flops`` for MFU.
    """
    m = load_model(model) if isinstance(model, str) else model
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    ranks = stages if pp is None else pp
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ScheduleError(f"dp = {dp!r} must be a whole number >= 1")
    eff = DEFAULT_EFFICIENCY if efficiency is None else efficiency
    mem_eff = DEFAULT_MEMORY_EFFICIENCY if memory_efficiency is None else memory_efficiency
    priced = price_stages(
        m,
        hw,
        stages=stages,
        seq=seq,
        microbatch_size=microbatch_size,
        dtype=dtype,
        efficiency=eff,
        memory_efficiency=mem_eff,
        state_bytes=state_bytes,
        grad_bytes=grad_bytes,
        blocks=None if blocks is None else list(blocks),
        attention=attention,
        dropout=dropout,
        tp=tp,
        sequence_parallel=sequence_parallel,
        tp_across_nodes=tp_across_nodes,
    )
    costs = tuple(
        StageCost(
            F=p.F,
            I=p.I,
            W=p.W,
            R=p.R,
            act=p.act,
            act_w=p.act_w,
            ckpt=p.ckpt if recompute else 0.0,
            weights=p.weights,
            grad_bytes=p.grad_bytes,
            boundary_bytes=p.boundary_bytes,
            OFFLOAD=p.act / hw.host_bandwidth,
            RELOAD=p.act / hw.host_bandwidth,
            weight_copy=p.weights / hw.host_bandwidth,
        )
        for p in priced
    )
    far = pipeline_crosses_nodes(ranks, dp, hw.gpus_per_node, tp)
    dp_far = replicas_cross_nodes(dp, hw.gpus_per_node, tp)
    tokens = microbatch_size * seq
    return CostModel(
        costs,
        latency=hw.inter_latency if far else hw.intra_latency,
        bandwidth=hw.inter_bandwidth if far else hw.intra_bandwidth,
        unit="bytes",
        dp=dp,
        dp_latency=ring_allreduce_latency(dp, hw.inter_latency if dp_far else hw.intra_latency),
        dp_bandwidth=hw.inter_bandwidth if dp_far else hw.intra_bandwidth,
        meta={
            "source": "spec",
            "time_unit": "s",
            "model": m.name,
            "hardware": hw.name,
            "params": m.params(),
            "seq": seq,
            "microbatch_size": microbatch_size,
            "dtype": dtype,
            "efficiency": eff,
            "memory_efficiency": mem_eff,
            "attention": attention,
            "dropout": dropout,
            "tp": tp,
            "sequence_parallel": sequence_parallel and tp > 1,
            "blocks": [p.blocks for p in priced],
            "pipeline_link": "network" if far else "node",
            "replica_link": "network" if dp_far else "node",
            "flops_per_microbatch": m.flops_per_token(seq) * tokens,
            "peak_flops": hw.peak(dtype),
        },
    )
