"""Sums across processes: replicas of the pipeline (data parallel, FSDP2), the collectives over
the pipeline's ranks, and the gradient sums a step makes beyond REDUCE_GRAD."""
