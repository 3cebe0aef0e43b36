"""Schedule generators: pure functions of (ranks, microbatches, chunks); no torch import."""
