"""What tensor parallelism (tp) changes in a transformer block's price, as plain numbers.

Megatron-LM's tensor parallelism (Shoeybi et al. 2019; Narayanan et al. 2021, Section
2.3) cuts every block's linears across ``tp`` GPUs: the query/key/value and first FFN
matrices by columns, the attention output and second FFN matrices by rows, so each GPU
holds ``1/tp`` of the weights and of the attention heads.  What that costs and saves,
per block and microbatch of ``T`` tokens (``h`` = hidden):

* **Collectives.**  Megatron's conjugate ``f``/``g`` operators: two all-reduces of the
  block's ``T x h`` activation forward (after the attention and after the FFN), two of
  its gradient in the input-gradient pass, none in the weight-gradient pass; a
  recomputed forward repeats the forward two.  With sequence parallelism (Korthikanti
  et al. 2022) each all-reduce becomes a reduce-scatter and an all-gather, which move
  the same bytes in a ring.  A ring over ``tp`` GPUs moves ``2 (tp - 1) / tp`` of the
  bytes through each GPU's link in ``2 (tp - 1)`` steps (:func:`ring_allreduce`), at
  :data:`TP_LINK_EFFICIENCY` of the link's bandwidth.  Nothing overlaps them with
  compute (Megatron-LM of 2021 did not).  A vocabulary-parallel embedding adds one
  all-reduce forward, a vocabulary-parallel head one in its input gradient.
* **Compute** is divided by ``tp``, at a lower rate: a matmul ``w`` wide reaches
  ``w / (w + MATMUL_HALF_WIDTH)`` of what a very wide one does (a saturating curve:
  half the rate at :data:`MATMUL_HALF_WIDTH`), so cutting the hidden width ``h`` into
  ``h / tp`` per GPU multiplies the matmul efficiency by :func:`matmul_share`.  The
  share is relative to the uncut width, so ``tp = 1`` prices exactly as before.
* **Memory.**  Weights, gradients and optimizer state are divided by ``tp`` (the
  norms are copied on every GPU; they are a few thousandths of a block).  Activations
  and memory-bound work inside the tensor-parallel region (q, k, v, attention scores,
  FFN intermediates, the activation function) are divided by ``tp``; those outside it
  (the norms' inputs and outputs, residual adds, dropout masks on the ``h``-wide
  stream) are divided only with sequence parallelism (:func:`split`).
* **Pipeline transfers** carry ``1/tp`` of the activation per GPU: with sequence
  parallelism it is sharded already; without it, as Megatron-LM's scatter/gather
  optimisation sends it (each GPU sends its slice, the next stage all-gathers it inside
  its node; that all-gather is not priced).

No torch here, and nothing from :mod:`zeropipe.planning.specs` or
:mod:`zeropipe.planning.pricing.transformer` (which import this).
"""

from __future__ import annotations

from zeropipe.core.errors import ScheduleError

__all__ = [
    "MATMUL_HALF_WIDTH",
    "TP_LINK_EFFICIENCY",
    "check_tp",
    "kv_split",
    "matmul_share",
    "ring_allreduce",
    "split",
]

#: The per-GPU matmul width (columns of the narrow operand) at which a matmul reaches
#: half the rate of a very wide one, in ``w / (w + MATMUL_HALF_WIDTH)``.  One constant for
#: every model and GPU, set so that Megatron-LM's Table 1 rows at tp = 2, 4 and 8 (hidden
#: 768 to 3200 per GPU) are priced within their published figures; at 128 a 768-wide
#: matmul runs at 0.87 of a 6144-wide one, the order of what cuBLAS loses on narrow tiles.
MATMUL_HALF_WIDTH = 128.0
#: The share of a node link's one-way bandwidth a ring collective's bus bandwidth reaches
#: (NCCL's all-reduce on 8 NVLink GPUs reaches about 0.8 of the NVLink figure for the
#: hundreds of megabytes a block's activation holds).
TP_LINK_EFFICIENCY = 0.8


def check_tp(
    tp: int,
    *,
    heads: int,
    kv_heads: int,
    ffn: int,
    gpus_per_node: int,
    cross_node: bool = False,
    model: str = "model",
) -> None:
    """Refuse a tensor-parallel degree the model or the node cannot take, naming the fix.

    ``tp`` must divide the attention heads and the FFN width (each GPU holds whole heads
    and an equal slice); key/value heads are cut when ``tp`` divides them and copied when
    they divide ``tp`` (grouped-query attention with fewer groups than GPUs).  Unless
    ``cross_node``, ``tp`` must divide the GPUs of a node: its collectives run on every
    block, on the node's link.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ScheduleError(f"tp = {tp!r} must be a whole number >= 1")
    if tp == 1:
        return
    if not cross_node and gpus_per_node % tp:
        raise ScheduleError(
            f"tp {tp} does not divide the {gpus_per_node} GPUs of a node: tensor parallelism "
            f"runs its collectives on every block, on the node's link; give a divisor of "
            f"{gpus_per_node}"
        )
    if heads % tp or ffn % tp:
        raise ScheduleError(
            f"{model}: tp {tp} must divide the attention heads ({heads}) and the FFN width "
            f"({ffn}); give a common divisor, e.g. {_largest_common(tp, heads, ffn)}"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ScheduleError(
            f"{model}: tp {tp} and the {kv_heads} key/value heads: one must divide the other "
            f"(heads cut, or copied); give a divisor or multiple of {kv_heads}"
        )


def _largest_common(tp: int, *values: int) -> int:
    return max(d for d in range(1, tp + 1) if all(v % d == 0 for v in values))


def kv_split(kv_heads: int, tp: int) -> int:
    """How many ways the key/value heads are cut: ``tp`` when it divides them, else
    ``kv_heads`` (each GPU holds one head, copied ``tp / kv_heads`` times)."""
    return min(tp, kv_heads)


def matmul_share(width: int, tp: int) -> float:
    """The matmul efficiency at ``width / tp`` per GPU over that at ``width``:
    ``g(width / tp) / g(width)`` with ``g(w) = w / (w + MATMUL_HALF_WIDTH)``; 1 at tp = 1."""
    if tp == 1:
        return 1.0

    def g(w: float) -> float:
        return w / (w + MATMUL_HALF_WIDTH)

    return g(width / tp) / g(width)


def ring_allreduce(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """Seconds a ring all-reduce (or a reduce-scatter and an all-gather) of ``nbytes``
    over ``ranks`` GPUs takes: ``2 (ranks - 1)`` steps, each a message of ``nbytes /
    ranks``, at :data:`TP_LINK_EFFICIENCY` of ``bandwidth`` (bytes/s, one way)."""
    if ranks <= 1:
        return 0.0
    steps = 2 * (ranks - 1)
    return steps * latency + steps / ranks * nbytes / (bandwidth * TP_LINK_EFFICIENCY)


def split(outside: float, inside: float, tp: int, sequence_parallel: bool) -> float:
    """Per GPU, a quantity with a part ``outside`` the tensor-parallel region (copied on
    every GPU unless the sequence is cut) and a part ``inside`` it (divided by ``tp``)."""
    return (outside / tp if sequence_parallel else outside) + inside / tp
