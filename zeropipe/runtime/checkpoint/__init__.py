"""Checkpoints: a pipeline's state in torch's distributed checkpoint format, and the folder on
disk that is never half-written."""
