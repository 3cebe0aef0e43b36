"""What ``zeropipe train`` trains: the model, its cut, its loss and its text.

The training loop of :mod:`zeropipe.apps.train` asks this module for

    check_model(cfg)                    one-line errors for --model / --model-config
    load_corpus(cfg)                    the generated corpus, or the bytes of --data FILE
    model_layers(cfg, vocab)            the layers a schedule's stages are cut from
    describe_layers(cfg, vocab)         those layers counted and named, for messages
    build_model(cfg, vocab, stages)     the GPT of zeropipe.apps.models.gpt and its cut, or a
                                        Hugging Face model (zeropipe.apps.models.hf) cut into
                                        stages by zeropipe.adapters.split; and the model
    loss_fn(cfg)                        the loss that model's outputs are scored with
    batch(corpus, cfg, step)            a step's inputs and targets, on --device

The settings come as any object with the fields of :class:`ModelSettings`
(``zeropipe.apps.train.TrainConfig`` is one), so this module need not import the
command that uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from zeropipe.adapters.loss import causal_lm_loss
from zeropipe.adapters.split import split
from zeropipe.apps.data import Corpus
from zeropipe.apps.models.gpt import LAYERS, GPTConfig, gpt, gpt_layers, lm_loss
from zeropipe.apps.models.hf import PRESETS, build_hf, hf_config
from zeropipe.core.errors import ZeropipeError
from zeropipe.planning.balance import even_cut

__all__ = [
    "ModelSettings",
    "batch",
    "build_model",
    "check_model",
    "describe_layers",
    "load_corpus",
    "loss_fn",
    "model_layers",
]


class ModelSettings(Protocol):
    """The fields of ``zeropipe.apps.train.TrainConfig`` that decide the model and its data."""

    model: str  # gpt, or a Hugging Face preset / a --model-config file's model_type
    model_config: str | None
    data: str | None
    batch_size: int
    seq: int
    width: int
    blocks: int  # transformer blocks (--blocks)
    heads: int
    dropout: float
    device: str
    seed: int


def check_model(cfg: ModelSettings) -> None:
    """One-line errors for a ``--model`` / ``--model-config`` that names no model we build."""
    if cfg.model not in ("gpt", *PRESETS) and cfg.model_config is None:
        raise ZeropipeError(
            f"unknown --model {cfg.model!r}; choose gpt, {', '.join(PRESETS)}, or give "
            f"--model-config FILE.json for another config of those architectures"
        )
    if cfg.model_config is not None and cfg.model == "gpt":
        raise ZeropipeError(
            "--model-config describes a Hugging Face model, not --model gpt: leave --model "
            "out (the architecture is the file's model_type)"
        )


def load_corpus(cfg: ModelSettings) -> Corpus:
    """The training text: ``--data``'s bytes, or the generated corpus."""
    if cfg.data is not None:
        return Corpus.from_file(cfg.data, cfg.seq)
    return Corpus.generate(seed=cfg.seed)


def _hf_config(cfg: ModelSettings, vocab: int) -> Any:
    """The transformers config of ``--model`` / ``--model-config`` for ``vocab`` tokens."""
    return hf_config(
        cfg.model,
        vocab=vocab,
        width=cfg.width,
        blocks=cfg.blocks,
        heads=cfg.heads,
        seq=cfg.seq,
        dropout=cfg.dropout,
        config_file=cfg.model_config,
    )


def _blocks(cfg: ModelSettings, vocab: int) -> int:
    if cfg.model == "gpt":
        return cfg.blocks
    return int(_hf_config(cfg, vocab).num_hidden_layers)  # --blocks, or the config file's


def model_layers(cfg: ModelSettings, vocab: int) -> int:
    """The model's layers: the most stages it can be cut into.

    The GPT's ``nn.Sequential`` is its embedding, the attention and MLP of each
    block, and its head; a Hugging Face model's stages hold whole decoder layers
    (blocks), with the embedding and the head beside them.
    """
    blocks = _blocks(cfg, vocab)
    return gpt_layers(blocks) if cfg.model == "gpt" else blocks + 2


def describe_layers(cfg: ModelSettings, vocab: int) -> str:
    """:func:`model_layers` counted and named, e.g. '10 layers (4 blocks; embedding, ...)'."""
    blocks = _blocks(cfg, vocab)
    what = LAYERS if cfg.model == "gpt" else "embedding, each block, head"
    return f"{model_layers(cfg, vocab)} layers ({blocks} block{'s' * (blocks != 1)}; {what})"


def _balance(blocks: int, stages: int, per_block: int = 1) -> list[int]:
    """Layers per stage: blocks (of ``per_block`` layers) spread evenly, plus the embedding on
    the first stage and the head on the last (so under zbv, which puts both on rank 0, the
    ranks stay even)."""
    layers = blocks * per_block + 2
    if stages == 1:
        return [layers]
    if blocks < stages:  # too few blocks for one each: spread every layer evenly
        return even_cut(layers, stages)
    counts = [per_block * c for c in even_cut(blocks, stages)]
    counts[0] += 1
    counts[-1] += 1
    return counts


def build_model(
    cfg: ModelSettings, vocab: int, num_stages: int
) -> tuple[torch.nn.Sequential | list[torch.nn.Module], list[int] | None, torch.nn.Module]:
    """What the pipeline runs: the GPT and its cut, or a Hugging Face model's stages; and the
    whole model, whose ``state_dict`` names are the checkpoint's keys whatever the cut."""
    if cfg.model == "gpt":
        gpt_cfg = GPTConfig(
            vocab=vocab,
            seq=cfg.seq,
            width=cfg.width,
            heads=cfg.heads,
            layers=cfg.blocks,
            dropout=cfg.dropout,
        )
        # The GPT's blocks are two layers each (attention, MLP).
        cut = _balance(cfg.blocks, num_stages, per_block=2)
        whole = gpt(gpt_cfg, seed=cfg.seed).to(cfg.device)
        return whole, cut, whole
    config = _hf_config(cfg, vocab)
    model = build_hf(config, cfg.seed).to(cfg.device)
    blocks = int(config.num_hidden_layers)
    # The GPT's cut with the embedding and head taken off: a fixed cut (not a measured
    # one), so that a checkpoint's stages fit the same run resumed.
    cut = _balance(blocks, num_stages)
    if num_stages > 1:
        cut[0] -= 1
        cut[-1] -= 1
    else:
        cut = [blocks]
    return split(model, num_stages, balance=cut), None, model


def loss_fn(cfg: ModelSettings) -> Callable[..., Any]:
    """The GPT's next-token loss, or HF's shifted causal-LM loss (counted by tokens)."""
    return lm_loss if cfg.model == "gpt" else causal_lm_loss


def batch(
    corpus: Corpus, cfg: ModelSettings, step: int, split_name: str = "train"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets: next tokens for the GPT; HF models take labels = inputs and shift."""
    x, y = corpus.batch(step, cfg.batch_size, cfg.seq, seed=cfg.seed, split=split_name)
    if cfg.model != "gpt":
        y = x
    return x.to(cfg.device), y.to(cfg.device)
