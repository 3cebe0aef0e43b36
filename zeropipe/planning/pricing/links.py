"""Which link a transfer takes: where the ranks of a mesh sit, and a ring's fixed cost.

Ranks are laid out tensor-parallel innermost, then data-parallel, then pipeline (a
``("pp", "dp", "tp")`` DeviceMesh; context parallelism sits between tp and dp:
:func:`zeropipe.planning.pricing.context_parallel.ring_crosses_nodes`), so a group of
at most one node's GPUs that divides the node stays inside it, on NVLink.  No torch here.
"""

from __future__ import annotations

__all__ = ["pipeline_crosses_nodes", "replicas_cross_nodes", "ring_allreduce_latency"]


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
