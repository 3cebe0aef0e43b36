"""``zeropipe train --cp N``: every sequence sharded over N processes per pipeline rank.

The run's mesh gets a "cp" dimension (``("pp", "dp", "cp", "tp")``: ranks x dp x cp x tp
processes); the Hugging Face model's stages are sharded over it by
``zeropipe.parallelize(stages, cp_mesh=mesh["cp"])`` (:mod:`zeropipe.adapters.context_parallel`);
every cp process of a replica is given the replica's whole batch and keeps its share of each
row; gradients, token counts and the loss are summed over dp x cp by the pipeline.

:func:`check_context_parallel` is one of :data:`zeropipe.apps.train.config.RULES`: what
cannot work is refused in one line before any process starts.
"""

from __future__ import annotations

from typing import Any

from zeropipe.adapters.hf import SUPPORTED
from zeropipe.adapters.tp import parallelize
from zeropipe.apps.data.tokens import data_vocab
from zeropipe.apps.models.hf_presets import hf_class_name
from zeropipe.apps.train.workload import hf_model_config
from zeropipe.core.errors import ZeropipeError

__all__ = ["check_context_parallel", "shard_sequences"]


def check_context_parallel(cfg: Any) -> None:
    """``--cp N``: at least 1; above 1, a Llama-family Hugging Face model (the reference
    GPT and the mixtures of experts have no context-parallel attention yet), a ``--seq``
    that ``2 x N`` divides (each process an early and a late chunk), no ``--ep``."""
    if cfg.cp < 1:
        raise ZeropipeError(f"--cp must be >= 1 (1: no context parallelism), got {cfg.cp}")
    if cfg.cp == 1:
        return
    families = "--model llama or qwen3, or a --model-config of llama, mistral, qwen2 or qwen3"
    if cfg.model == "gpt":
        raise ZeropipeError(
            f"--cp {cfg.cp} with --model gpt: context parallelism shards the attention of a "
            f"Hugging Face Llama-family model; use --cp 1, or {families}"
        )
    if cfg.seq % (2 * cfg.cp):
        raise ZeropipeError(
            f"--cp {cfg.cp} with --seq {cfg.seq}: each sequence is cut into {2 * cfg.cp} equal "
            f"chunks (an early and a late one per process); use a --seq divisible by "
            f"{2 * cfg.cp}"
        )
    if cfg.ep > 1:
        raise ZeropipeError(
            f"--cp {cfg.cp} with --ep {cfg.ep}: mixtures of experts are not context-parallel "
            f"yet; use one of the two"
        )
    config = hf_model_config(cfg, data_vocab(cfg.data, cfg.tokenizer, cfg.seed))
    kind = hf_class_name(config, cfg.seed)
    if SUPPORTED.get(kind) != "llama":
        llama = [name for name, family in SUPPORTED.items() if family == "llama"]
        raise ZeropipeError(
            f"--cp {cfg.cp} with --model {cfg.model}: context parallelism covers "
            f"{', '.join(llama)}, not {kind} (mixtures of experts and GPT-2 are not "
            f"context-parallel yet); use --cp 1, or {families}"
        )


def shard_sequences(stages: Any, mesh: Any, cp: int) -> None:
    """The stages sharded over the mesh's "cp" dimension (nothing when ``cp`` is 1)."""
    if cp > 1:
        parallelize(stages, cp_mesh=mesh["cp"])
