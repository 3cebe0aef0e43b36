"""What a mixture of experts and expert parallelism (ep) cost, per block and microbatch.

A block of a mixture-of-experts model (:class:`~zeropipe.planning.pricing.transformer.ModelSpec`
with ``experts`` > 0) routes each of its ``T`` tokens to ``k`` = ``experts_per_token`` of
``E`` = ``experts`` gated FFNs ``f_e`` wide, beside ``shared_experts`` every token passes
through; its first blocks may be dense (``dense_blocks``).  Its attention may be
multi-head latent attention (``mla``).  :func:`price_moe_block` prices such a block the
way :func:`~zeropipe.planning.pricing.transformer.price_block` prices a dense one, with:

* **Compute by active weights**: the linears a token passes through, ``2 T n_active``
  FLOPs forward, as much for I and for W, ``n_active`` = attention + ``(k + shared)``
  experts + the router (``h E``).  An expert's matmuls are ``f_e`` wide where a dense
  model's are about ``h``: they run at :func:`expert_share` of the dense rate (the same
  saturating curve tensor parallelism uses for narrow matmuls).  Routing is taken as
  balanced (dropless, each GPU's experts get ``T k`` token-expert pairs a microbatch):
  a skewed router's slowest GPU is not priced.
* **Attention**: flash, ``T s (d_qk + d_v)`` FLOPs forward for score width ``d_qk`` and
  value width ``d_v`` (latent attention: ``heads x (qk_nope + qk_rope)`` and ``heads x
  v_head``), 2.5 times that backward; unfused: as the dense formula, at the mean width.
* **Memory-bound work**: the dense block's norms, residual adds and rotary, the gated
  activation of every active expert, and the token permutation around the experts
  (gather into expert order and the weighted scatter back: ``T h`` read and ``T k h``
  written each way forward, twice that backward).
* **Expert parallelism** (``ep`` GPUs share the routed experts, ``E / ep`` each): each
  MoE block's forward dispatches every token's hidden state to the GPUs holding its ``k``
  experts and combines the results back (two all-to-alls); its input gradient does the
  same backward.  A token's state crosses NVLink once per GPU, and the network once per
  node, holding some of its experts, as DeepEP sends it (a group-limited router, as
  DeepSeek-V3's, bounds the nodes).  The ep group is ``ep`` neighbouring data-parallel
  replicas (ep inside dp, as Megatron-LM and torchtitan lay it out: ``ep`` divides
  ``dp``), ranks ``tp`` apart; what goes to peers inside the node crosses NVLink, the rest
  the network, both at once (:func:`all_to_all_time`).  Inside a stage nothing hides
  them (F and I include them); an overlapped pair (DualPipeV) hides each half's
  all-to-all under the other half's compute, as far as that compute lasts
  (:func:`pair_overlap`).
* **Memory**: a GPU keeps ``E / ep`` experts of each MoE block (``expert_params``; the
  cost model keeps their weights, gradients and optimizer state apart from the rest,
  sharded over the ``dp / ep`` replicas that hold the same experts where the optimizer or
  FSDP is sharded).  Activations kept: the dense block's around attention, the permuted
  tokens (``T k h``) and each active expert's gate, up and product (``3 T k f_e``).

* **Tensor parallelism** (``tp`` GPUs a block, as :mod:`zeropipe.adapters.tp` lays a
  mixture out): attention is cut by heads (latent attention's head projections, ``q_b`` or
  ``q`` and ``kv_b``, and its output; its latent projections and norms, before the heads,
  are whole on every GPU), as are a dense block's FFN and the shared experts; the router
  and the routed experts are whole on every GPU, so their compute, weights, gradients,
  optimizer state and activations are not divided by ``tp``, nor is the token permutation.
  Each GPU of the ``tp`` holds the same experts and routes the same whole hidden states,
  exchanged with its own ep group (the replicas' GPUs at its tp position): every GPU
  dispatches and combines all of its replica's tokens, as at tp 1.  The collectives are
  priced as :mod:`zeropipe.planning.pricing.tensor_parallel` prices a dense block's: one
  all-reduce of the ``T x h`` activation forward and one of its gradient in I for
  attention and for a dense FFN or the shared experts (a block of routed experts alone has
  no FFN collective); latent attention's I sums the narrower gradients of its latents and
  shared rotary key instead (:meth:`~zeropipe.planning.pricing.transformer.MLAShape.latent_widths`).
  The cut matmuls run at tp's narrower rate, the whole ones at the uncut rate.  Sequence
  parallelism does not apply: the whole experts need whole sequences
  (:func:`check_sequence_parallel`).

No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from zeropipe.core.errors import ScheduleError
from zeropipe.planning.balance import balance
from zeropipe.planning.pricing.tensor_parallel import (
    MATMUL_HALF_WIDTH,
    TP_LINK_EFFICIENCY,
    kv_split,
    matmul_share,
)
from zeropipe.planning.pricing.transformer import LayerPrice, LayerRun, ModelSpec, price_block

__all__ = [
    "A2A_LINK_EFFICIENCY",
    "PassTimes",
    "all_to_all_time",
    "block_kinds",
    "check_ep",
    "check_sequence_parallel",
    "copies_per_token",
    "cut_by_time",
    "expert_share",
    "pair_overlap",
    "price_moe_block",
    "stage_blocks",
]

#: A kind of block: whether it routes to experts, and its price.
Kind = tuple[bool, LayerPrice]

#: The share of a link's one-way bandwidth an all-to-all reaches: NCCL's, as for the
#: tensor-parallel ring (:data:`~zeropipe.planning.pricing.tensor_parallel.TP_LINK_EFFICIENCY`).
A2A_LINK_EFFICIENCY = TP_LINK_EFFICIENCY


def check_ep(ep: int, *, model: ModelSpec, dp: int | None, tp: int) -> None:
    """Refuse an expert-parallel degree the model or the layout cannot take, naming the fix:
    ``ep`` must divide the experts and the data-parallel degree (ep inside dp); a dense
    model takes only ep 1 (``dp`` None: not checked against it); ``tp`` must cut the shared
    experts evenly."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ScheduleError(f"ep = {ep!r} must be a whole number >= 1")
    shared = model.shared_experts * model.expert_ffn
    if model.is_moe and shared % tp:
        raise ScheduleError(
            f"{model.name}: tp {tp} must divide the shared experts' width ({shared}): tensor "
            f"parallelism cuts them as a dense FFN"
        )
    if ep == 1:
        return
    if not model.is_moe:
        raise ScheduleError(f"{model.name} has no experts: ep {ep} shards nothing; give ep 1")
    if model.experts % ep:
        raise ScheduleError(
            f"{model.name}: ep {ep} must divide the {model.experts} experts (each GPU holds "
            f"an equal share)"
        )
    if dp is not None and dp % ep:
        raise ScheduleError(
            f"ep {ep} must divide dp {dp}: the experts are sharded inside the data-parallel "
            f"replicas (as Megatron-LM and torchtitan lay them out)"
        )


def check_sequence_parallel(model: ModelSpec, tp: int, sequence_parallel: bool) -> None:
    """Refuse sequence parallelism for a mixture of experts or latent attention at tp > 1:
    its routed experts (and latent projections) are whole on every GPU of the tp and take
    whole sequences, so the residual stream is not cut (:mod:`zeropipe.adapters.tp` refuses
    it too)."""
    if tp > 1 and sequence_parallel and (model.experts or model.mla is not None):
        raise ScheduleError(
            f"{model.name}: tp {tp} with sequence parallelism: a mixture of experts' or latent "
            f"attention's tensor parallelism keeps the router, the routed experts and the "
            f"latents whole on every GPU, on whole sequences; give sequence_parallel=False "
            f"(zeropipe plan: --no-sequence-parallel)"
        )


def _width_share(width: float, hidden: int) -> float:
    """The rate of a matmul ``width`` wide over a dense block's (``hidden`` wide):
    ``g(width) / g(hidden)`` with ``g(w) = w / (w + MATMUL_HALF_WIDTH)``, at most 1."""

    def g(w: float) -> float:
        return w / (w + MATMUL_HALF_WIDTH)

    return min(1.0, g(width) / g(hidden))


def expert_share(model: ModelSpec) -> float:
    """The rate of an expert's matmuls over a dense block's: ``g(f_e) / g(h)`` with
    ``g(w) = w / (w + MATMUL_HALF_WIDTH)`` (1 when the experts are as wide as the model)."""
    return _width_share(model.expert_ffn, model.hidden)


def copies_per_token(experts: int, top_k: int, holders: int) -> float:
    """How many of ``holders`` (GPUs or nodes, ``experts / holders`` experts each) a token's
    ``top_k`` experts fall on, on average, the experts drawn uniformly without repeats:
    ``holders x (1 - C(E - E / holders, k) / C(E, k))``."""
    if holders <= 1:
        return 1.0
    per = experts // holders
    missed = 1.0  # the chance that a given holder has none of the token's experts
    for i in range(top_k):
        missed *= max(0, experts - per - i) / (experts - i)
    return holders * (1.0 - missed)


def all_to_all_time(
    token_bytes: float,
    tokens: int,
    model: ModelSpec,
    ep: int,
    *,
    tp: int,
    gpus_per_node: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
) -> float:
    """Seconds one dispatch (or combine) takes: each of a GPU's ``tokens`` hidden states
    (``token_bytes``) goes to the GPUs of the ``ep`` group that hold its experts.

    As DeepEP sends them: once to each GPU holding one of its top-k experts (not once per
    expert), and across nodes once to each node holding one (over the network, then
    forwarded inside that node over NVLink), :func:`copies_per_token` of each (across nodes,
    within the groups a group-limited router allows: :func:`_nodes_per_token`).  The
    group's ranks are ``tp`` apart (ep neighbouring replicas): ``min(ep, node / tp)`` of them
    share a node.  At tp > 1 each of a replica's tp GPUs holds the same routed experts,
    uncut, and routes the same whole hidden states: each GPU sends all ``tokens`` over its
    own group, at once with the replica's other tp GPUs, each on its own link (its share of
    the network).  What crosses NVLink (``intra``: bandwidth and latency) and what crosses
    the network (``inter``) move at once, each at :data:`A2A_LINK_EFFICIENCY`; one latency
    for the concurrent messages.
    """
    if ep <= 1:
        return 0.0
    in_node = max(1, min(ep, gpus_per_node // max(tp, 1)))
    nodes = ep // in_node
    k, experts = model.experts_per_token, model.experts
    gpus = copies_per_token(experts, k, ep)  # copies that reach a GPU, its own included
    near = tokens * token_bytes * gpus * (ep - 1) / ep
    seconds = near / (intra[0] * A2A_LINK_EFFICIENCY)
    if nodes == 1:
        return intra[1] + seconds
    remote = _nodes_per_token(model, nodes) * (nodes - 1) / nodes
    far = tokens * token_bytes * remote
    return inter[1] + max(seconds, far / (inter[0] * A2A_LINK_EFFICIENCY))


def _nodes_per_token(model: ModelSpec, nodes: int) -> float:
    """How many of the ep group's ``nodes`` a token's experts fall on: with group-limited
    routing whose groups each fill whole nodes (``nodes`` a multiple of the groups), among
    the nodes of its ``groups_per_token`` groups only (DeepSeek-V3 routes a token to at most
    4 nodes this way); else as if routed uniformly (:func:`copies_per_token`)."""
    k, experts, groups = model.experts_per_token, model.experts, model.expert_groups
    chosen = model.groups_per_token
    if groups > 1 and chosen < groups and nodes % groups == 0:
        per_group = nodes // groups
        return copies_per_token(chosen * experts // groups, k, chosen * per_group)
    return copies_per_token(experts, k, nodes)


@dataclass(frozen=True)
class _BlockWeights:
    """One GPU's (of ``tp``) weights of a block in its linears, by the rate they run at."""

    cut: int  # 1/tp of attention's head projections and of a dense FFN: tp's narrower rate
    whole: int  # latent attention's projections before the heads, the router: uncut rate
    shared: int  # 1/tp of the shared experts: their narrower width's rate
    routed: int  # a token's top-k routed experts, whole: the experts' rate

    @staticmethod
    def of(model: ModelSpec, tp: int, moe: bool) -> _BlockWeights:
        """The weights of one of ``model``'s blocks, an MoE one (``moe``) or a dense one;
        key/value heads fewer than ``tp`` copied, as :func:`price_block` prices them."""
        h = model.hidden
        if model.mla is not None:
            whole = model.mla.latent_params(h)
            cut = (model.attention_params() - whole) // tp
        else:
            kv_t = model.kv_dim * tp // kv_split(model.kv_heads, tp)
            cut, whole = (h * (model.dim + 2 * kv_t) + model.dim * h) // tp, 0
        if not moe:
            ffn = (3 if model.gated else 2) * h * model.ffn
            return _BlockWeights(cut + ffn // tp, whole, 0, 0)
        shared = model.shared_experts * model.expert_params() // tp
        routed = model.experts_per_token * model.expert_params()
        return _BlockWeights(cut, whole + h * model.experts, shared, routed)

    def seconds(self, model: ModelSpec, run: LayerRun) -> float:
        """Seconds of the linears in one pass (F, I and W alike: ``2 T n`` FLOPs each).

        ``run.flop_rate`` is the uncut rate times ``narrow`` (:func:`matmul_share`), so a
        weight at the uncut rate weighs ``narrow`` of one at ``flop_rate``, and the
        shared experts' (``f_e / tp`` wide) weigh ``expert_share / their share`` of a
        routed expert's; at tp 1 every ratio is 1."""
        t, flop, tp = run.tokens, run.flop_rate, run.tp
        narrow = matmul_share(model.hidden, tp)
        share = expert_share(model)
        shared_ratio = share / _width_share(model.expert_ffn / tp, model.hidden)
        dense = self.cut + self.whole * narrow
        if not (self.routed or self.shared):  # a dense block
            return 2.0 * t * dense / flop
        experts = self.routed * narrow + self.shared * narrow * shared_ratio
        return 2.0 * t * dense / flop + 2.0 * t * experts / (flop * share)

    @property
    def params(self) -> int:
        """Weights of the block this GPU holds in its linears but the routed experts."""
        return self.cut + self.whole + self.shared


def price_moe_block(
    model: ModelSpec, run: LayerRun, *, moe: bool, attention: str = "flash", dropout: bool = False
) -> LayerPrice:
    """One block of a model with experts or latent attention on one GPU of ``run.tp`` (see
    the module docstring): ``moe`` says whether its FFN is routed experts or dense (``ffn``
    wide)."""
    t, e, seq, h, tp = run.tokens, run.element_bytes, run.seq, model.hidden, run.tp
    mem = run.byte_rate
    qk, v = (width // tp for width in model.score_dims())  # this GPU's heads
    k = model.experts_per_token + model.shared_experts if moe else 0
    weights = _BlockWeights.of(model, tp, moe)
    linear_s = weights.seconds(model, run)
    d = (qk + v) // 2  # attention's mean width
    if moe:  # the routed experts whole, the shared ones cut
        ffn_width = model.experts_per_token * model.expert_ffn
        ffn_width += model.shared_experts * model.expert_ffn // tp
    else:
        ffn_width = model.ffn // tp
    ffn_act = (3 if model.gated or moe else 2) * ffn_width
    saved_qkv, rotary = _attention_widths(model, tp)
    # Elementwise bytes forward: norms and residual adds (10 h), rotary, the activation;
    # the permutation around the experts (read T h, write T k h, and back).
    ew = t * e * (10.0 * h + 2.0 * rotary + ffn_act)
    if moe:
        ew += t * e * 2.0 * (h + model.experts_per_token * h)
    ew_i = 2.0 * ew
    act = t * e * (5.0 * h + saved_qkv + ffn_act)
    if moe:
        act += t * e * model.experts_per_token * h  # the permuted tokens
    if model.mla is not None:
        act += t * e * (model.mla.q_lora_rank + model.mla.kv_lora_rank)  # the latents
    if attention == "flash":
        attention_f, attention_i = 2.0 * t * seq * d, 5.0 * t * seq * d
    else:
        attention_f, attention_i = 4.0 * t * seq * d, 8.0 * t * seq * d
        scores = t * seq * (model.heads // tp)
        drop = 1 if dropout else 0
        ew += scores * ((4 + 2 * drop) * e + drop)
        ew_i += scores * ((7 + 2 * drop) * e + drop)
        act += scores * ((1 + drop) * e + drop)
    if dropout:
        ew += 2 * t * h
        ew_i += 2 * t * h
        act += 2 * t * h
    a2a = 2.0 * run.all_to_all if moe else 0.0  # dispatch and combine
    collective_f, collective_i = _tp_collectives(model, run, moe)
    block_f = linear_s + attention_f / run.flop_rate + ew / mem + a2a + collective_f
    block_i = linear_s + attention_i / run.flop_rate + ew_i / mem + a2a + collective_i
    block_w = linear_s
    routed = model.experts * model.expert_params() if moe else 0
    return LayerPrice(
        F=block_f,
        I=block_i,
        W=block_w,
        act=act,
        act_w=min(act, t * e * (4.0 * h + qk + v + ffn_act + k * h)),
        params=weights.params + 2 * h,  # the two norms whole
        time=block_f + block_i + block_w,
        expert_params=routed // run.ep,
        all_to_all_f=a2a,
        all_to_all_i=a2a,
    )


def _tp_collectives(model: ModelSpec, run: LayerRun, moe: bool) -> tuple[float, float]:
    """Seconds of a block's tensor-parallel all-reduces forward and in I (none at tp 1):
    attention's and, but in a block of routed experts alone, the FFN's (a dense FFN or the
    shared experts), one each way; latent attention's I all-reduces its latents' and rotary
    key's gradients, narrower than ``h``: priced as that share of ``run.allreduce`` (the
    ring's bytes dominate at a block's sizes).  Each GPU's expert all-to-all is its own
    (:func:`all_to_all_time`): tp adds none."""
    if run.tp == 1:
        return 0.0, 0.0
    ffn = 0 if moe and not model.shared_experts else 1
    attention_i = 1.0 if model.mla is None else model.mla.latent_widths(model.hidden) / model.hidden
    return (1 + ffn) * run.allreduce, (attention_i + ffn) * run.allreduce


def _attention_widths(model: ModelSpec, tp: int) -> tuple[int, int]:
    """Per token and GPU of ``tp``: the query, key and value elements kept for backward,
    and those rotary embedding rewrites (grouped-query: all of q and k, key/value heads
    fewer than tp copied; latent: the rotary dims of the GPU's heads and the shared key)."""
    if model.mla is None:
        kv_t = model.kv_dim * tp // kv_split(model.kv_heads, tp)
        return (model.dim + 2 * kv_t) // tp, (model.dim + kv_t) // tp
    mla, heads = model.mla, model.heads // tp
    return heads * (2 * mla.qk_head_dim + mla.v_head_dim), (heads + 1) * mla.qk_rope_head_dim


class PassTimes(Protocol):
    """A layer's or a stage's pass times and the all-to-all inside them (seconds)."""

    @property
    def F(self) -> float: ...
    @property
    def I(self) -> float: ...  # noqa: E743
    @property
    def W(self) -> float: ...
    @property
    def all_to_all_f(self) -> float: ...
    @property
    def all_to_all_i(self) -> float: ...


def pair_overlap(prices: Sequence[PassTimes]) -> float:
    """The share of ``min(F, B)`` an overlapped pair (a forward and a backward of stages
    ``prices``, one each) hides: each half's all-to-all under the other half's compute, as
    far as that compute lasts; the least over the stages given (0 without all-to-all)."""
    shares = []
    for p in prices:
        if not (p.all_to_all_f or p.all_to_all_i):
            continue
        backward = p.I + p.W
        hidden = min(p.all_to_all_f, backward - p.all_to_all_i)
        hidden += min(p.all_to_all_i, p.F - p.all_to_all_f)
        shares.append(min(1.0, hidden / min(p.F, backward)))
    return min(shares, default=0.0)


def block_kinds(model: ModelSpec, run: LayerRun, *, attention: str, dropout: bool) -> list[Kind]:
    """Each kind of block the model has, priced: a dense model's one kind
    (:func:`~zeropipe.planning.pricing.transformer.price_block`), else dense and MoE blocks
    (:func:`price_moe_block`), those present; sequence parallelism at tp > 1 refused for
    the latter (:func:`check_sequence_parallel`)."""
    if not (model.experts or model.mla is not None):
        return [(False, price_block(model, run, attention=attention, dropout=dropout))]
    check_sequence_parallel(model, run.tp, run.sequence_parallel)
    present = sorted(set(model.moe_blocks()))
    return [
        (moe, price_moe_block(model, run, moe=moe, attention=attention, dropout=dropout))
        for moe in present
    ]


def stage_blocks(
    model: ModelSpec, kinds: list[Kind], start: int, count: int
) -> list[tuple[int, LayerPrice]]:
    """Blocks ``start`` to ``start + count`` of the model as (count, price) per kind."""
    if len(kinds) == 1:
        return [(count, kinds[0][1])]
    held = model.moe_blocks()[start : start + count]
    return [(held.count(moe), price) for moe, price in kinds]


def cut_by_time(
    model: ModelSpec, kinds: list[Kind], stages: int, first: float, last: float
) -> list[int]:
    """Blocks per stage when they differ (dense first blocks): contiguous, the slowest stage
    as fast as can be (:func:`~zeropipe.planning.balance.balance`), the first stage also
    running the embedding (``first`` seconds), the last the head (``last``)."""
    price = dict(kinds)
    times = [price[moe].time for moe in model.moe_blocks()]
    times[0] += first
    times[-1] += last
    return balance(times, stages)
