"""A decoder-only transformer: its shape, and what each layer costs from its FLOPs and bytes.

:class:`ModelSpec` is the shape (blocks, hidden size, heads, FFN width, vocabulary) with
the counts read off it: weights, training FLOPs per token.  A layer is a transformer
block, the embedding or the output head (with the final norm's weights and the loss); its
price (:class:`LayerPrice`) is one GPU's (of the ``tp`` a tensor-parallel stage runs on)
for one microbatch, at the rates of a :class:`LayerRun`.
:func:`zeropipe.planning.specs.price_stages` sums these prices into stages.
``T`` = tokens per microbatch = microbatch size x sequence:

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
* **Tensor parallelism**: what ``tp`` divides, the collectives it adds and the narrower
  matmuls' lower rate are in :mod:`zeropipe.planning.pricing.tensor_parallel`.
* **Context parallelism** (``cp`` GPUs a sequence): ``T`` is one GPU's share of the
  tokens, ``s`` the whole sequence, and the ring's transfers beyond the attention they
  overlap are added: :mod:`zeropipe.planning.pricing.context_parallel`.
* **Kernels** (:class:`Kernels`, optional): attention at its own share of the peak (a
  flash kernel reaches less of it than a large matmul), the blocks' linears in float8
  (:data:`FLOAT8_LINEAR_SPEEDUP`), and how context-parallel attention moves keys and
  values.  Without them every matmul, attention included, runs at one ``efficiency``.
* **Mixtures of experts and multi-head latent attention** (``experts`` > 0, ``mla``): a
  block's FFN is routed experts (``experts_per_token`` of ``experts``, each ``expert_ffn``
  wide) and ``shared_experts``, but the ``dense_blocks``; such blocks are priced by
  :mod:`zeropipe.planning.pricing.moe`, which also prices expert parallelism.  A dense
  model's figures do not depend on these fields.

No torch here, and nothing from :mod:`zeropipe.planning.specs` (which imports this).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zeropipe.core.errors import ScheduleError
from zeropipe.planning.hf_config import spec_fields
from zeropipe.planning.pricing.context_parallel import (
    RingAttention,
    backward_exposed,
    forward_exposed,
    gathered_bytes,
)
from zeropipe.planning.pricing.tensor_parallel import kv_split, split

__all__ = [
    "ATTENTION_KINDS",
    "FLASH_ATTENTION_2_EFFICIENCY",
    "FLOAT8_LINEAR_SPEEDUP",
    "Kernels",
    "LayerPrice",
    "LayerRun",
    "MLAShape",
    "ModelSpec",
    "checkpoint_blocks",
    "price_block",
    "price_embedding",
    "price_head",
]

ATTENTION_KINDS = ("flash", "unfused")  # how attention is computed (see the docstring)

# Share of an H100's dense bf16 peak FlashAttention-2 reaches: torch's flash SDPA backend
# (FlashAttention-2 kernels; cuDNN's is opt-in, pytorch/pytorch#138522) measured 329 of
# 989 TFLOP/s on a 2024-12-04 nightly (pytorch/pytorch#142132); the FlashAttention-3 paper
# (Shah et al. 2024) puts FlashAttention-2 at 35% of the H100's peak.
FLASH_ATTENTION_2_EFFICIENCY = 0.33
# How much faster the blocks' linears run in float8 (torchao's dynamic scaling, the
# output head kept in bf16): the speedup that, priced by this module with attention at
# FLASH_ATTENTION_2_EFFICIENCY, turns torchtitan's published Llama 3.1 8B step on 8 H100s
# (benchmarks/llama3_h100_202412_torchtitan.md, Table 1: FSDP + torch.compile, selective
# checkpointing, 6,667 tokens/s per GPU) into its Float8 one (8,532);
# benchmarks/long_context_table.py prints the check, tests/planning/test_cp_plan.py holds
# it within 1%.
FLOAT8_LINEAR_SPEEDUP = 1.49


@dataclass(frozen=True)
class Kernels:
    """How a run's kernels differ from one matmul efficiency for everything:
    ``attention_efficiency``: the share of the dense peak attention reaches (None: the
    matmuls' ``efficiency``); ``float8_linears``: the blocks' linears
    :data:`FLOAT8_LINEAR_SPEEDUP` times faster (their weights, activations and the head
    stay in the compute dtype); ``ring``: how context-parallel attention moves keys and
    values."""

    attention_efficiency: float | None = None
    float8_linears: bool = False
    ring: RingAttention = field(default_factory=RingAttention)

    def __post_init__(self) -> None:
        value = self.attention_efficiency
        if value is not None and not (0 < value <= 1):
            raise ScheduleError(f"attention_efficiency = {value!r} must be in (0, 1]")

    def key_values(self, model: ModelSpec) -> tuple[int, int]:
        """The width and heads of the keys and values context parallelism moves."""
        if self.ring.expanded_kv:
            return model.dim, model.heads
        return model.kv_dim, model.kv_heads

    def rates(self, peak: float) -> dict[str, Any]:
        """:class:`LayerRun`'s attention rate (FLOP/s, of a dense ``peak``) and the linears'
        speedup where these kernels set them."""
        rates: dict[str, Any] = {}
        if self.attention_efficiency is not None:
            rates["attention_rate"] = peak * self.attention_efficiency
        if self.float8_linears:
            rates["linear_speedup"] = FLOAT8_LINEAR_SPEEDUP
        return rates

    def describe(self) -> dict[str, Any]:
        """The settings a cost model records."""
        return {
            "attention_efficiency": self.attention_efficiency,
            "float8_linears": self.float8_linears,
            "cp_rotation": self.ring.rotation,
            "cp_expanded_kv": self.ring.expanded_kv,
        }


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a ``q_lora_rank``
    latent (0: a plain ``hidden x heads (qk_nope + qk_rope)`` projection), keys and values
    through a ``kv_lora_rank`` latent plus one shared ``qk_rope_head_dim``-wide rotary key;
    each head scores with ``qk_nope + qk_rope`` dims and reads ``v_head_dim`` dims."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, hidden: int, heads: int) -> int:
        """Attention weights of one block: the query path, the key/value latent path and its
        norms, and the output projection."""
        qk = heads * self.qk_head_dim
        if self.q_lora_rank:
            query = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * qk
        else:
            query = hidden * qk
        latent = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return query + latent + up + heads * self.v_head_dim * hidden

    def latent_params(self, hidden: int) -> int:
        """Of :meth:`params`, the weights before the heads, which tensor parallelism keeps
        whole on every GPU: the query latent's projection and norm, the key/value latent's
        projection (with the shared rotary key) and norm."""
        query = hidden * self.q_lora_rank + self.q_lora_rank
        return query + hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank

    def latent_widths(self, hidden: int) -> int:
        """Per token, the widths whose gradients tensor parallelism sums over its GPUs in
        backward: what enters the heads' projections (the query latent, or the hidden state
        without one; the key/value latent) and the shared rotary key every head reads."""
        return (self.q_lora_rank or hidden) + self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape: dense, or a mixture of experts (``experts`` > 0:
    every block but the ``dense_blocks`` routes each token to ``experts_per_token`` of
    ``experts`` gated FFNs ``expert_ffn`` wide, beside ``shared_experts`` every token
    passes through; ``ffn`` is the dense blocks' width) with, optionally, multi-head latent
    attention (``mla``)."""

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
    experts: int = 0  # routed experts per MoE block (0: a dense model)
    experts_per_token: int = 0  # top-k routed experts per token
    shared_experts: int = 0
    expert_ffn: int = 0  # FFN width of one expert
    dense_blocks: tuple[int, ...] = ()  # blocks (0-based) with a dense FFN in an MoE model
    mla: MLAShape | None = None
    # Group-limited routing (DeepSeek-V3's n_group, topk_group): the experts in
    # ``expert_groups`` equal groups, a token's top-k drawn from ``groups_per_token`` of them.
    expert_groups: int = 1
    groups_per_token: int = 1

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
        # JSON gives lists and objects: held as a tuple and an MLAShape.
        object.__setattr__(self, "dense_blocks", tuple(self.dense_blocks))
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLAShape(**self.mla))
        if self.experts or self.experts_per_token or self.expert_ffn or self.shared_experts:
            self._check_experts()

    def _check_experts(self) -> None:
        """Refuse a mixture of experts whose counts cannot be priced, naming the field."""
        for name in ("experts", "experts_per_token", "expert_ffn"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(
                    f"model {self.name!r}: {name} = {value!r} must be an int >= 1 in a mixture "
                    f"of experts"
                )
        if self.experts_per_token > self.experts:
            raise ScheduleError(
                f"model {self.name!r}: experts_per_token ({self.experts_per_token}) exceeds the "
                f"{self.experts} experts"
            )
        if not isinstance(self.shared_experts, int) or self.shared_experts < 0:
            raise ScheduleError(
                f"model {self.name!r}: shared_experts = {self.shared_experts!r} must be an int >= 0"
            )
        groups, chosen = self.expert_groups, self.groups_per_token
        if groups < 1 or self.experts % groups or not 1 <= chosen <= groups:
            raise ScheduleError(
                f"model {self.name!r}: expert_groups = {groups!r} must divide the "
                f"{self.experts} experts and groups_per_token = {chosen!r} be in 1..{groups}"
            )
        outside = [b for b in self.dense_blocks if not 0 <= b < self.layers]
        if outside:
            raise ScheduleError(
                f"model {self.name!r}: dense_blocks {outside} are not blocks of a "
                f"{self.layers}-block model"
            )

    @property
    def is_moe(self) -> bool:
        """Whether some block routes tokens to experts."""
        return self.experts > 0 and len(set(self.dense_blocks)) < self.layers

    def moe_blocks(self) -> list[bool]:
        """For each block, whether its FFN is routed experts."""
        dense = set(self.dense_blocks)
        return [self.experts > 0 and b not in dense for b in range(self.layers)]

    def attention_params(self) -> int:
        """Attention weights of one block (grouped-query or latent)."""
        if self.mla is not None:
            return self.mla.params(self.hidden, self.heads)
        return self.hidden * (self.dim + 2 * self.kv_dim) + self.dim * self.hidden

    def expert_params(self) -> int:
        """Weights of one routed expert (gated: three matrices)."""
        return 3 * self.hidden * self.expert_ffn

    def block_params(self, moe: bool, *, active: bool = False) -> int:
        """Weights of one block, a dense or an MoE one (norms and router included);
        ``active``: only those a token is multiplied by (its top-k and shared experts)."""
        if not moe:
            ffn = (3 if self.gated else 2) * self.hidden * self.ffn
        else:
            routed = self.experts_per_token if active else self.experts
            ffn = (routed + self.shared_experts) * self.expert_params()
            ffn += self.hidden * self.experts  # the router
        return self.attention_params() + ffn + 2 * self.hidden

    def score_dims(self) -> tuple[int, int]:
        """Widths of all heads together that attention scores with (query and key) and
        reads (value)."""
        if self.mla is not None:
            return self.heads * self.mla.qk_head_dim, self.heads * self.mla.v_head_dim
        return self.dim, self.dim

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
        if self.experts or self.mla is not None:
            blocks = sum(self.block_params(moe) for moe in self.moe_blocks())
            return embedding + blocks + self.hidden + head
        return embedding + self.layers * self.layer_params() + self.hidden + head

    def active_params(self) -> int:
        """Weights a token is multiplied by or looks up: :meth:`params` with only the
        top-k and shared experts of each MoE block."""
        if not self.experts:
            return self.params()
        blocks = sum(self.block_params(moe, active=True) for moe in self.moe_blocks())
        embedding = self.vocab * self.hidden
        return embedding + blocks + self.hidden + (0 if self.tied_embeddings else embedding)

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token by the usual convention for MFU: ``6 N + 12 L d s``.

        ``N`` counts every weight a token is multiplied by (blocks and output head,
        not the embedding lookup); ``12 L d s`` is attention's score and value
        products forward and backward without skipping the causal mask.  No
        recomputation is counted: MFU counts the model's work, not the plan's.  In a
        mixture of experts ``N`` is the active weights (top-k and shared experts, router);
        with latent attention ``2 d`` is the score and value widths, ``6 L s (d_qk + d_v)``.
        """
        if self.experts or self.mla is not None:
            blocks = sum(self.block_params(moe, active=True) for moe in self.moe_blocks())
            qk, v = self.score_dims()
            return 6.0 * (blocks + self.vocab * self.hidden) + 6.0 * self.layers * (qk + v) * seq
        matmul = self.layers * self.layer_params() + self.vocab * self.hidden
        return 6.0 * matmul + 12.0 * self.layers * self.dim * seq

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str = "") -> ModelSpec:
        """Read a Hugging Face ``config.json``'s contents (a known decoder-only type:
        :data:`zeropipe.planning.hf_config.DECODER_TYPES`); anything else is refused."""
        return cls(**spec_fields(config, where=f"config of model {name!r}", name=name))


@dataclass(frozen=True)
class LayerRun:
    """What every layer of a stage runs under: one microbatch on one GPU of ``tp``."""

    tokens: int  # T: microbatch size x sequence
    seq: int  # tokens per sequence (attention's s)
    element_bytes: int  # bytes of one activation element in the compute dtype
    flop_rate: float  # FLOP/s a matmul reaches (at tp's narrower width)
    byte_rate: float  # bytes/s memory-bound work reaches
    allreduce: float  # seconds of one tensor-parallel all-reduce of the T x h activation
    tp: int = 1
    sequence_parallel: bool = True
    ep: int = 1  # GPUs the routed experts are sharded over (expert parallel)
    all_to_all: float = 0.0  # seconds of one dispatch (or combine) of an MoE block's tokens
    cp: int = 1  # GPUs a sequence is sharded over (context parallel; ``tokens`` is one's)
    ring_f: float = 0.0  # seconds of one forward ring step (this GPU's keys and values)
    ring_i: float = 0.0  # seconds of one backward ring step (and their gradients)
    rotation: str = "ring"  # how the keys and values travel (context_parallel.ROTATIONS)
    merge_f: float = 0.0  # bytes through memory a sub-attention after the first, forward
    merge_i: float = 0.0  # the same, backward
    attention_rate: float = 0.0  # FLOP/s attention reaches (0: flop_rate)
    linear_speedup: float = 1.0  # the blocks' linears run at flop_rate times this

    def matmul_seconds(self, linear: float, attention: float) -> float:
        """Seconds of ``linear`` FLOPs of the blocks' linears and ``attention`` FLOPs of
        attention, over ``tp``, each at its rate."""
        if not self.attention_rate and self.linear_speedup == 1.0:
            return (linear + attention) / self.tp / self.flop_rate
        linear_rate = self.flop_rate * self.linear_speedup
        return linear / self.tp / linear_rate + self.attention_seconds(attention)

    def attention_seconds(self, attention: float) -> float:
        """Seconds of ``attention`` FLOPs of attention over ``tp``."""
        return attention / self.tp / (self.attention_rate or self.flop_rate)


@dataclass(frozen=True)
class LayerPrice:
    """One layer's seconds and bytes for one microbatch on one GPU (StageCost's fields)."""

    F: float
    I: float
    W: float
    act: float  # bytes kept for backward
    act_w: float  # of them, bytes W still needs after I
    params: int  # this GPU's weights of the layer (but its routed experts')
    time: float  # F + I + W: what cutting the model into stages weighs
    expert_params: int = 0  # this GPU's share of the routed experts' weights
    all_to_all_f: float = 0.0  # of F, seconds of all-to-all (dispatch and combine)
    all_to_all_i: float = 0.0  # of I, the same


def price_block(
    model: ModelSpec, run: LayerRun, *, attention: str = "flash", dropout: bool = False
) -> LayerPrice:
    """One transformer block: attention and FFN linears, attention itself, the
    memory-bound work around them and its tensor-parallel collectives."""
    t, e, tp, sp, seq = run.tokens, run.element_bytes, run.tp, run.sequence_parallel, run.seq
    h, kv, f, d = model.hidden, model.kv_dim, model.ffn, model.dim
    # Key/value heads fewer than tp are copied: as if kv_t wide, cut tp ways.
    kv_t = kv * tp // kv_split(model.kv_heads, tp)
    n = model.layer_params() - 2 * h + 2 * h * (kv_t - kv)  # weights in linears, over tp GPUs
    ffn_mats = 3 if model.gated else 2
    ffn_act = 3 * f if model.gated else 2 * f

    # Linears: 2 t n FLOPs each for F, I and W.  Flash attention: 2 t s d forward
    # (causal: half of the 4 t s d of a full square), 2.5x backward.
    # Elementwise bytes forward: two norms (read + write h each) and two residual adds
    # (read 2, write 1) outside the tensor-parallel region; rotary on q and k and the
    # activation (gated: read 2 f, write f) inside it; backward twice that.
    ew_out, ew_in = t * e * 10.0 * h, t * e * (2.0 * (d + kv_t) + ffn_act)
    ew_out_i, ew_in_i = 2 * ew_out, 2 * ew_in
    # Saved for backward: norm inputs and outputs (4 h) outside; q k v (d + 2 kv),
    # attention output (h-wide), FFN gate/up/product (3 f) or pre/post activation (2 f).
    act_out, act_in = t * e * 4.0 * h, t * e * (h + d + 2.0 * kv_t + ffn_act)
    gathered = run.rotation == "gather" and run.cp > 1  # zeropipe's own cp: a dense mask
    if attention == "flash":
        # (causal: half of the full square; under zeropipe's cp's dense mask, all of it)
        attention_f, attention_i = (4.0, 10.0) if gathered else (2.0, 5.0)
        attention_f, attention_i = attention_f * t * seq * d, attention_i * t * seq * d
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
    if gathered:  # the other ranks' keys and values (at their width, over tp) and the mask
        block_act += gathered_bytes(run.cp, tokens=t, seq=seq, key_values=2.0 * kv_t * e / tp)
    mem, allreduce = run.byte_rate, run.allreduce
    block_f = run.matmul_seconds(2.0 * t * n, attention_f) + elementwise_f / mem + 2 * allreduce
    block_i = run.matmul_seconds(2.0 * t * n, attention_i) + elementwise_i / mem + 2 * allreduce
    # Context parallel: the keys' and values' travel, hidden under attention where it can.
    seconds_f, seconds_i = run.attention_seconds(attention_f), run.attention_seconds(attention_i)
    block_f += forward_exposed(run.cp, run.rotation, run.ring_f, seconds_f)
    block_i += backward_exposed(run.cp, run.rotation, run.ring_f, run.ring_i, seconds_i)
    block_f += (run.cp - 1) * run.merge_f / mem  # merges after each sub-attention but the first
    block_i += (run.cp - 1) * run.merge_i / mem
    block_w = run.matmul_seconds(2.0 * t * n, 0.0)
    # W needs each linear's input and its output's gradient: the h-wide ones outside.
    linear_in_out = d + f + (d + 2 * kv_t) + (ffn_mats - 1) * f  # inside; 4 h outside
    return LayerPrice(
        F=block_f,
        I=block_i,
        W=block_w,
        act=block_act,
        act_w=min(block_act, split(t * e * 4.0 * h, t * e * linear_in_out, tp, sp)),
        params=n // tp + 2 * h,  # its slice of the linears, the norms whole
        time=block_f + block_i + block_w,
    )


def checkpoint_blocks(
    parts: Sequence[tuple[int, LayerPrice]], block_input: float
) -> tuple[float, float, float]:
    """What checkpointing every block on its own (``torch.utils.checkpoint`` around each
    block, Hugging Face's gradient checkpointing, torchtitan's full activation
    checkpointing) does to a stage of ``parts`` (a count of each kind of block): the
    seconds its I gains, the bytes it keeps, and its workspace.

    Each block keeps only its input (``block_input`` bytes) and runs its forward again at
    the start of its backward, once the gradient has arrived; it holds its whole
    activations while that backward runs, one block at a time: the stage's workspace
    (:class:`~zeropipe.core.costs.StageCost`).  W still needs what it always needs."""
    return (
        sum(k * p.F for k, p in parts),
        sum(k for k, _ in parts) * block_input,
        max((p.act for k, p in parts if k), default=0.0),
    )


def price_head(model: ModelSpec, run: LayerRun) -> LayerPrice:
    """The final norm's weights, the output head and the float32 loss over the logits,
    vocabulary-parallel (cut ``tp`` ways, like the logits); its input gradient is
    all-reduced over tp."""
    t, e, tp, sp, h = run.tokens, run.element_bytes, run.tp, run.sequence_parallel, model.hidden
    flop, mem = run.flop_rate, run.byte_rate
    head_n = model.vocab * h
    head_f = (2.0 * t * head_n / flop + t * model.vocab * 4 * 2 / mem) / tp  # + fp32 loss
    head_i = (2.0 * t * head_n / flop + t * model.vocab * 4 * 3 / mem) / tp + run.allreduce
    head_w = 2.0 * t * head_n / tp / flop
    return LayerPrice(
        F=head_f,
        I=head_i,
        W=head_w,
        act=split(t * e * h, t * 4.0 * model.vocab, tp, sp),  # input, fp32 logits
        act_w=split(t * e * h, 0.0, tp, sp),
        params=h + head_n // tp,
        time=head_f + head_i + head_w,
    )


def price_embedding(model: ModelSpec, run: LayerRun) -> LayerPrice:
    """The embedding, vocabulary-parallel: a lookup forward (then an all-reduce over tp),
    a scatter-add in W; memory-bound, no activation kept."""
    t, e, h = run.tokens, run.element_bytes, model.hidden
    embed_time = split(t * h * e * 3, 0.0, run.tp, run.sequence_parallel) / run.byte_rate
    return LayerPrice(
        F=embed_time / 3 + run.allreduce,
        I=0.0,
        W=embed_time * 2 / 3,
        act=0.0,
        act_w=0.0,
        params=model.vocab * h // run.tp,
        time=embed_time + run.allreduce,
    )
