"""A small GPT as an ``nn.Sequential``, so a pipeline can cut it anywhere.

::

    tokens -> Embed(token + position) -> Block x n -> Head(LayerNorm, Linear tied to Embed)
                                          |
                                          x + Attention(LN(x)); x + MLP(LN(x))

By default the head's projection *is* the embedding's weight (tied
input/output embeddings), so a pipeline whose first and last stages sit on
different ranks has to sum that parameter's gradient across them.
``GPTConfig(tied=False)`` gives the head its own weight: ``zeropipe bench``
uses it, because torch.distributed.pipelining has no tied parameters across
stages to compare with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "LAYERS",
    "GPTConfig",
    "checkpoint_layers",
    "gpt",
    "gpt_layers",
    "lm_loss",
    "parallelize_gpt",
]

#: What the layers (entries of the ``nn.Sequential``, the unit a cut counts) of
#: :func:`gpt` are, for messages that count them: a block is two layers.
LAYERS = "embedding, attention and MLP of each block, head"


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq: int = 64
    width: int = 128
    heads: int = 4
    layers: int = 4  # blocks (attention + MLP); the Sequential has gpt_layers(layers) layers
    dropout: float = 0.1
    tied: bool = True  # the head's projection is the token embedding's weight
    checkpoint: bool = False  # each attention and MLP layer checkpointed (checkpoint_layers)


class Embed(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.token = nn.Embedding(cfg.vocab, cfg.width)
        self.position = nn.Embedding(cfg.seq, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens: Tensor) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.token(tokens) + self.position(pos))


class Checkpointable(nn.Module):
    """A layer that, with ``gradient_checkpointing`` set (:func:`checkpoint_layers`; the flag
    Hugging Face's layers carry), keeps only its input and runs its forward again in its
    backward (``torch.utils.checkpoint``, which replays the same dropout masks)."""

    gradient_checkpointing = False

    def forward(self, x: Tensor) -> Tensor:
        if self.gradient_checkpointing and torch.is_grad_enabled():
            out: Tensor = checkpoint(self.layer, x, use_reentrant=False)
            return out
        return self.layer(x)

    def layer(self, x: Tensor) -> Tensor:
        raise NotImplementedError


def checkpoint_layers(model: nn.Module) -> None:
    """Checkpoint each attention and MLP layer of ``model`` on its own."""
    for m in model.modules():
        if isinstance(m, Checkpointable):
            m.gradient_checkpointing = True


class Attention(Checkpointable):
    """The first half of a pre-LN block: ``x + Dropout(proj(attention(LN(x))))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        # Separate projections, so that tensor parallelism can give each rank whole heads
        # of all three by cutting each weight's rows (parallelize_gpt).
        self.q = nn.Linear(cfg.width, cfg.width)
        self.k = nn.Linear(cfg.width, cfg.width)
        self.v = nn.Linear(cfg.width, cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.p = cfg.dropout

    def layer(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        h = self.ln1(x)
        # -1 heads: under tensor parallelism a rank holds heads / tp of them, whole.
        q, k, v = (z(h).view(b, t, -1, c // self.heads).transpose(1, 2) for z in self.qkv)
        a = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0
        )
        return x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, -1)))

    @property
    def qkv(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return (self.q, self.k, self.v)


class MLP(Checkpointable):
    """The second half of a pre-LN block: ``x + Dropout(down(GELU(up(LN(x)))))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln2 = nn.LayerNorm(cfg.width)
        self.up = nn.Linear(cfg.width, 4 * cfg.width)
        self.down = nn.Linear(4 * cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def layer(self, x: Tensor) -> Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class Head(nn.Module):
    def __init__(self, embed: Embed, tied: bool = True) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(embed.token.embedding_dim)
        self.out = nn.Linear(embed.token.embedding_dim, embed.token.num_embeddings, bias=False)
        if tied:
            self.out.weight = embed.token.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.ln(x))


def gpt_layers(blocks: int) -> int:
    """The layers of a GPT of ``blocks`` blocks: embedding, attention and MLP of each, head."""
    return 2 * blocks + 2


def gpt(cfg: GPTConfig | None = None, *, seed: int = 0) -> nn.Sequential:
    """The model, initialised deterministically from ``seed`` (same on every rank)."""
    cfg = cfg or GPTConfig()
    if cfg.width % cfg.heads:
        raise ValueError(f"width {cfg.width} must be a multiple of heads {cfg.heads}")
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        embed = Embed(cfg)
        model = nn.Sequential(
            embed,
            *[half for _ in range(cfg.layers) for half in (Attention(cfg), MLP(cfg))],
            Head(embed, cfg.tied),
        )
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            if name.endswith(("down.weight", "proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))
    finally:
        torch.random.set_rng_state(gen_state)
    if cfg.checkpoint:
        checkpoint_layers(model)
    return model


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy.

    Under a pipeline a scalar loss is weighted by rows, which is exact here because every
    row of a :class:`~zeropipe.apps.data.corpus.Corpus` batch has ``seq`` real targets.  With padded
    targets (``-100``) it would not be: return ``(summed loss, (targets != -100).sum())``
    and pass ``Pipeline(loss_count=...)`` (see :mod:`zeropipe.runtime.step.loss_contract`).
    """
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parallelize_gpt(model: nn.Sequential, tp_mesh: object) -> None:
    """Tensor parallelism (Megatron's layout) on :func:`gpt`'s blocks over ``tp_mesh`` (1-D).

    Per attention, q, k and v are cut by columns (each rank: heads / tp whole heads) and
    the output projection by rows; per MLP, up by columns and down by rows: two
    all-reduces per block forward, two backward.  Embeddings, LayerNorms and the head
    stay replicated (the loss runs on whole logits).  Raises ``ValueError`` when the
    heads or the MLP width do not divide by the mesh's size.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = int(tp_mesh.size())  # type: ignore[attr-defined]
    for layer in model:
        if isinstance(layer, Attention):
            if layer.heads % tp:
                raise ValueError(
                    f"tensor parallelism {tp} must divide the GPT's {layer.heads} heads: pick "
                    f"--tp among the divisors of {layer.heads}"
                )
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()}
            parallelize_module(layer, tp_mesh, {**plan, "proj": RowwiseParallel()})  # type: ignore[arg-type]
        elif isinstance(layer, MLP):
            parallelize_module(
                layer,
                tp_mesh,  # type: ignore[arg-type]
                {"up": ColwiseParallel(), "down": RowwiseParallel()},
            )
