"""What context parallelism (cp) changes in a transformer block's price, as plain numbers.

Context parallelism shards each sequence over ``cp`` GPUs (torchtitan's and Megatron-LM's
``cp`` dimension): every GPU holds ``T / cp`` of a microbatch's ``T`` tokens through every
layer, and attention, which needs every earlier token, runs as **ring attention** (Liu et
al. 2023): the ``cp`` GPUs pass their keys and values around a ring, each computing its
queries against one shard's keys and values while the next shard arrives.  With causal
attention the sequence is cut into ``2 cp`` chunks and GPU ``r`` holds chunks ``r`` and
``2 cp - 1 - r`` (an early and a late one: the causal load balancing of torchtitan and
Megatron-LM), so every GPU does the same share of the causal work.  Per block and
microbatch, one GPU's:

* **Compute**: the linears and the memory-bound work see ``T / cp`` tokens; causal
  attention of the whole sequence ``s`` (``2 T s d`` FLOPs forward, flash style: half of
  the full square) is divided evenly, ``2 (T / cp) s d`` a GPU, 2.5 times that backward.
  :mod:`zeropipe.planning.pricing.transformer` prices exactly that once its ``tokens`` are
  the GPU's ``T / cp`` and its ``seq`` the whole ``s``.
* **The ring** (:class:`RingAttention`, rotation ``"ring"``, Megatron-LM's point-to-point
  ring): ``cp - 1`` steps a block forward, each sending the GPU's keys and values
  (``2 (T / cp) kv`` elements, ``kv`` the key/value width over ``tp``) to its neighbour;
  backward, ``cp - 1`` steps sending keys and values and their gradients (twice the bytes),
  as ring attention's backward passes them.  A step's transfer runs while the GPU computes
  attention against the shard it already holds (one ``cp``-th of the block's attention):
  only what the transfer takes beyond that compute is added (:func:`ring_exposed`), with a
  link latency a step.  A recomputed forward repeats the forward ring.
* **The all-gather** (rotation ``"allgather"``, the default of torch's
  ``context_parallel`` and of torchtitan's ``context_parallel_rotate_method``): forward,
  one all-gather of the ``cp - 1`` other shards, issued before the first sub-attention
  and waited on after it, so only that one ``cp``-th of the attention hides it
  (:func:`gather_exposed`); backward, the keys and values all-gathered again the same way,
  and their gradients, accumulated in float32 (torch's ``convert_to_f32``,
  :data:`GRADIENT_BYTES`), passed around the ring, each step hidden under the next
  sub-attention's backward but the last, which is waited on after the last sub-attention.
  torch's attention takes the keys and values as wide as the queries (torchtitan's Llama
  repeats the key/value heads before it: ``expanded_kv``), so those are what travel.  At
  every sub-attention after the first, torch merges the partial output into a float32 one
  and copies the keys and values on; backward, it accumulates the gradients in float32
  and copies them into one buffer for the ring: memory-bound work priced by its bytes
  (:data:`OUTPUT_MERGE_BYTES`, :data:`KEY_VALUE_COPY_BYTES`).
* **zeropipe's own** (rotation ``"gather"``, :mod:`zeropipe.adapters.context_parallel`): the
  keys and values all-gathered whole at their own width and waited on before attention,
  one attention over them under a dense mask (no causal block skipped: the whole local x
  whole rectangle, ``4 (T / cp) s d`` FLOPs forward), their gradients summed back to their
  owners after it (a reduce-scatter in the compute dtype): nothing overlapped.  Kept for
  backward beside the block's own: the other ranks' keys and values, and the mask, one
  byte per local x whole pair of a sequence (:func:`gathered_bytes`).
* **The link**: ranks are laid out tensor-parallel innermost, then context-parallel, then
  data-parallel, then pipeline (a ``("pp", "dp", "cp", "tp")`` mesh): a cp group is ``cp``
  ranks ``tp`` apart, inside a node while ``tp x cp`` GPUs fit one evenly, else its ring
  crosses the network (:func:`ring_crosses_nodes`); a step's message goes at
  :data:`~zeropipe.planning.pricing.tensor_parallel.TP_LINK_EFFICIENCY` of the link's
  one-way bandwidth (every GPU sends one and receives one at once).
* **Memory**: every activation a block keeps is the GPU's ``T / cp`` tokens' (the received
  key/value buffers are transient and not counted); weights are whole on every cp rank, and
  their gradients are reduced over the ``dp x cp`` ranks holding the same stage (FSDP and a
  sharded optimizer shard over them too, as torchtitan's ``dp_shard_cp`` mesh does).

What is refused (:func:`check_cp`): a ``cp`` below 1, a sequence not divisible by ``2 cp``
(the load-balanced chunks), unfused attention (ring attention is flash style), and a
mixture of experts or latent attention with ``cp`` > 1 (not priced).

No torch here, and nothing from :mod:`zeropipe.planning.specs` or
:mod:`zeropipe.planning.pricing.transformer` (which import this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zeropipe.core.errors import ScheduleError
from zeropipe.planning.pricing.tensor_parallel import TP_LINK_EFFICIENCY, kv_split

__all__ = [
    "GRADIENT_BYTES",
    "KEY_VALUE_COPY_BYTES",
    "OUTPUT_MERGE_BYTES",
    "ROTATIONS",
    "RingAttention",
    "backward_exposed",
    "check_cp",
    "forward_exposed",
    "gather_exposed",
    "gathered_bytes",
    "ring_crosses_nodes",
    "ring_exposed",
    "ring_step_time",
    "ring_steps",
]

ROTATIONS = ("ring", "allgather", "gather")  # how keys and values reach each cp rank (docstring)
# Bytes of a key/value gradient element the all-gather rotation's backward ring passes:
# torch's ring attention accumulates them in float32 (``_cp_options.convert_to_f32``).
GRADIENT_BYTES = 4
# Bytes the all-gather rotation (torch's ring attention, torch/distributed/tensor/experimental/
# _attention.py of 2024-12) moves through memory at each sub-attention after the first, as
# (forward, backward), per element of the GPU's attention output (its tokens x query width)
# and per key or value element as they travel.  Output, forward: the partial output cast to
# float32 (read 2, write 4), its difference with the merged one (read 8, write 4), scaled
# (read 4, write 4) and subtracted (read 8, write 4); backward: the query's gradient added
# into its float32 sum (read 6, write 4).  Keys and values, forward: copied into one buffer
# to pass on (read 2, write 2); backward: the same copy, their gradients added into float32
# sums (read 6, write 4) and copied into one buffer for the ring (read 4, write 4).
OUTPUT_MERGE_BYTES = (38, 10)
KEY_VALUE_COPY_BYTES = (4, 22)


@dataclass(frozen=True)
class RingAttention:
    """How context-parallel attention moves keys and values: ``rotation`` one of
    :data:`ROTATIONS`; ``expanded_kv``: the keys and values travel as wide as the queries
    (a model that repeats its key/value heads before attention), else at their own width."""

    rotation: str = "ring"
    expanded_kv: bool = False

    def __post_init__(self) -> None:
        if self.rotation not in ROTATIONS:
            raise ScheduleError(
                f"cp rotation {self.rotation!r}: give one of {', '.join(ROTATIONS)}"
            )


def check_cp(cp: int, *, seq: int, attention: str, moe: bool, name: str) -> None:
    """Refuse a context-parallel degree that cannot be priced, naming the fix: ``cp`` a
    whole number >= 1; above 1, ``seq`` divisible by ``2 cp``, flash attention and a dense
    model with grouped-query attention (``moe``: experts or latent attention)."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ScheduleError(f"cp = {cp!r} must be a whole number >= 1")
    if cp == 1:
        return
    if seq % (2 * cp):
        raise ScheduleError(
            f"cp {cp}: the sequence of {seq} tokens must split into 2 x cp = {2 * cp} equal "
            f"chunks (an early and a late one a GPU); give a seq divisible by {2 * cp}"
        )
    if attention != "flash":
        raise ScheduleError(f"cp {cp}: ring attention is flash style; give attention flash")
    if moe:
        raise ScheduleError(
            f"{name}: context parallelism of a mixture-of-experts or latent-attention model "
            f"is not priced; give cp 1"
        )


def ring_crosses_nodes(cp: int, tp: int, gpus_per_node: int) -> bool:
    """Whether a cp group's ring leaves its node: ``cp`` ranks ``tp`` apart, ``tp x cp``
    contiguous ranks holding it, inside a node only where they fit it evenly."""
    return cp > 1 and (tp * cp > gpus_per_node or gpus_per_node % (tp * cp) != 0)


def ring_step_time(nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds one ring step takes to pass ``nbytes`` to the next GPU (every GPU sends and
    receives one such message at once) at ``TP_LINK_EFFICIENCY`` of ``bandwidth``."""
    return latency + nbytes / (bandwidth * TP_LINK_EFFICIENCY)


def ring_exposed(cp: int, transfer: float, attention: float) -> float:
    """Seconds the ring adds to a block's pass: ``cp - 1`` steps, each a ``transfer``
    overlapped with the attention against the shard in hand (``attention / cp``, for the
    block's ``attention`` seconds on this GPU), only the excess exposed."""
    if cp <= 1:
        return 0.0
    return (cp - 1) * max(0.0, transfer - attention / cp)


def gather_exposed(cp: int, transfer: float, attention: float) -> float:
    """Seconds an all-gather of the ``cp - 1`` other shards (``transfer`` seconds each)
    adds to a block's pass: issued before the first sub-attention and waited on after it,
    it hides under that one ``cp``-th of the block's ``attention`` seconds only."""
    if cp <= 1:
        return 0.0
    return max(0.0, (cp - 1) * transfer - attention / cp)


def forward_exposed(cp: int, rotation: str, ring_f: float, attention: float) -> float:
    """Seconds the keys' and values' travel adds to a block's forward (``attention``: its
    seconds of attention on this GPU), by ``rotation`` (:data:`ROTATIONS`)."""
    if rotation == "gather":
        return max(0, cp - 1) * ring_f
    if rotation == "allgather":
        return gather_exposed(cp, ring_f, attention)
    return ring_exposed(cp, ring_f, attention)


def gathered_bytes(cp: int, *, tokens: int, seq: int, key_values: float) -> float:
    """What zeropipe's own cp (rotation ``"gather"``) keeps for a block's backward beyond
    the block's own activations, for a GPU of ``tokens`` tokens of sequences of ``seq``:
    the other ranks' keys and values (``key_values`` bytes a token) and the dense mask, one
    byte per (local, whole) pair of a sequence, which every row of a microbatch shares."""
    if cp <= 1:
        return 0.0
    return (cp - 1) * tokens * key_values + (seq // cp) * seq


def backward_exposed(
    cp: int, rotation: str, ring_f: float, ring_i: float, attention: float
) -> float:
    """Seconds the travel adds to a block's backward (``attention``: its seconds of
    attention backward): the ring's steps; or the all-gather again, the gradients' ring
    steps, and the last gradient step, waited on after the last sub-attention."""
    if rotation == "gather":
        return max(0, cp - 1) * ring_i
    if rotation != "allgather":
        return ring_exposed(cp, ring_i, attention)
    if cp <= 1:
        return 0.0
    return gather_exposed(cp, ring_f, attention) + ring_exposed(cp, ring_i, attention) + ring_i


def ring_steps(
    cp: int,
    tp: int,
    *,
    tokens: int,
    key_values: tuple[int, int],
    element_bytes: int,
    gpus_per_node: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    queries: tuple[int, int],
    ring: RingAttention | None = None,
) -> dict[str, Any]:
    """The seconds of one shard's keys and values on the link (``ring_f``) and of one
    backward ring step (``ring_i``) for a GPU holding ``tokens`` tokens' keys and values
    (``key_values``: the key/value width and heads, as they travel (see
    :class:`RingAttention`), of which the GPU holds its tensor-parallel share, a head copied
    where there are fewer than ``tp``), on the network where the ring leaves the node
    (:func:`ring_crosses_nodes`), else on NVLink (``intra`` and ``inter``: bandwidth in
    bytes/s one way, latency in seconds).  A backward step carries the keys and values and
    their gradients in the ``element_bytes`` of the ring rotation; the all-gather
    rotation's carries only the gradients, in :data:`GRADIENT_BYTES`, and its bytes through
    memory a sub-attention (``merge_f``, ``merge_i``) are counted for an output
    ``queries`` (width, heads) wide.  Nothing for cp 1."""
    if cp <= 1:
        return {}
    ring = ring or RingAttention()
    bandwidth, latency = inter if ring_crosses_nodes(cp, tp, gpus_per_node) else intra
    width, heads = key_values
    elements = 2.0 * tokens * (width // kv_split(heads, tp))
    keys_values = elements * element_bytes
    backward = {"ring": 2 * keys_values, "gather": keys_values}.get(
        ring.rotation, elements * GRADIENT_BYTES
    )
    out: dict[str, Any] = {
        "cp": cp,
        "rotation": ring.rotation,
        "ring_f": ring_step_time(keys_values, bandwidth, latency),
        "ring_i": ring_step_time(backward, bandwidth, latency),
    }
    if ring.rotation == "allgather":
        output = tokens * (queries[0] // kv_split(queries[1], tp))
        merged = zip(OUTPUT_MERGE_BYTES, KEY_VALUE_COPY_BYTES, strict=True)
        merge_f, merge_i = (o * output + k * elements for o, k in merged)
        out |= {"merge_f": merge_f, "merge_i": merge_i}
    return out
