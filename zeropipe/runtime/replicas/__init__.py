"""Sums across processes: replicas of the pipeline (data parallel, FSDP2), and the gradient
sums a step makes beyond REDUCE_GRAD (tied parameters, the norm of a clip)."""
