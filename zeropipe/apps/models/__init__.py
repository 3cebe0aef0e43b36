"""Small reference models for the demo, the tests and the benchmarks."""

from zeropipe.apps.models.gpt import GPTConfig, gpt
from zeropipe.apps.models.mlp import mlp_blocks

__all__ = ["GPTConfig", "gpt", "mlp_blocks"]
