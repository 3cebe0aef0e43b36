"""The causal language-model loss of Hugging Face models, usable inside a pipeline.

``causal_lm_loss(logits, labels)`` is what ``model(input_ids, labels=labels).loss``
computes: the labels shifted left by one (position ``t`` predicts token ``t + 1``),
cross-entropy averaged over the tokens whose label is not ``-100``::

    logits   [b, t, vocab]      labels  [b, t]
    predict  logits[:, :-1]     targets labels[:, 1:]   (-100: not counted)

Under a :class:`~zeropipe.runtime.pipeline.Pipeline` a batch's mean is not the
mean of its microbatches' means when they count different numbers of tokens, so
the pipeline calls :meth:`CausalLMLoss.sum_and_count` per microbatch and divides
by the batch's total :meth:`CausalLMLoss.count` (see :mod:`zeropipe.runtime.step.loss_contract`):
``Pipeline(stages, ..., loss_fn=zeropipe.causal_lm_loss)`` is exact as it is.

A split mixture of experts whose config asks for the router's loss ends in
``(logits, router_term)`` (:mod:`zeropipe.adapters.hf_moe`): the loss is then
the model's own, ``mean cross-entropy + router_term``, and
:meth:`CausalLMLoss.sum_and_count` returns ``(loss_sum, count, router_term)``,
a term the pipeline averages over the microbatches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from zeropipe.adapters.context_parallel import shard_indices
from zeropipe.core.errors import PipelineError

__all__ = ["CausalLMLoss", "ShardedCausalLMLoss", "causal_lm_loss"]


class CausalLMLoss:
    """Shifted next-token cross-entropy, a mean over the labels not equal to ``ignore_index``.

    Logits in a type narrower than float32 are upcast to float32 first, as
    Hugging Face does; float32 and float64 logits keep their type.
    """

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = ignore_index

    def __call__(self, logits: Tensor | tuple[Tensor, Tensor], labels: Tensor) -> Tensor:
        """The mean over counted tokens (``nan`` when none counts, as torch's mean gives),
        plus the router term when ``logits`` is ``(logits, router_term)``."""
        total, count, *term = self.sum_and_count(logits, labels)
        return total / count + term[0] if term else total / count

    def sum_and_count(
        self, logits: Tensor | tuple[Tensor, Tensor], labels: Tensor
    ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
        """The summed loss over counted tokens and how many there are; given
        ``(logits, router_term)`` (a scalar), that term as a third element."""
        if isinstance(logits, tuple) and len(logits) == 2 and _scalar(logits[1]):
            total, count, *_ = self.sum_and_count(logits[0], labels)
            return total, count, logits[1]
        if not isinstance(logits, Tensor) or logits.dim() != 3:
            raise PipelineError(
                f"causal_lm_loss takes logits [batch, seq, vocab], got "
                f"{_shape(logits)}; the last stage must return the LM head's logits"
            )
        if not isinstance(labels, Tensor) or labels.shape != logits.shape[:2]:
            got = list(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise PipelineError(
                f"causal_lm_loss: labels {got} must be [batch, seq] = "
                f"{list(logits.shape[:2])}, the input_ids' shape (pass labels=input_ids, "
                f"-100 where a token is not counted; the shift is done here)"
            )
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        predict = logits[:, :-1].reshape(-1, logits.shape[-1])
        target = labels[:, 1:].reshape(-1)
        total = F.cross_entropy(predict, target, ignore_index=self.ignore_index, reduction="sum")
        return total, self.count(labels)

    def count(self, labels: Tensor) -> Tensor:
        """How many tokens of ``labels`` [batch, seq] the loss counts (after the shift)."""
        # The pipeline counts every microbatch's labels before any logits exist, so this is
        # where a wrong shape is met first.
        if not isinstance(labels, Tensor) or labels.dim() != 2:
            raise PipelineError(
                f"causal_lm_loss takes labels [batch, seq] (logits [batch, seq, vocab]), got "
                f"{_shape(labels)}; pass labels shaped like input_ids (labels=input_ids, -100 "
                f"where a token is not counted; the shift is done here)"
            )
        return (labels[:, 1:] != self.ignore_index).sum()

    def context_parallel(self, rank: int, size: int) -> ShardedCausalLMLoss:
        """This loss on cp rank ``rank``'s tokens of ``size`` (a pipeline whose mesh has a
        "cp" dimension asks for it): :class:`ShardedCausalLMLoss`."""
        return ShardedCausalLMLoss(rank, size, self.ignore_index)

    def __repr__(self) -> str:
        return f"CausalLMLoss(ignore_index={self.ignore_index})"


class ShardedCausalLMLoss(CausalLMLoss):
    """:class:`CausalLMLoss` on one context-parallel rank's share of the sequence.

    The logits are the rank's tokens (``shard_indices``: chunks ``rank`` and
    ``2 x size - 1 - rank``) and the labels the whole rows: the labels are shifted on the
    whole sequence first (token ``t``'s target is label ``t + 1``; the last token has
    none), then the rank's tokens' targets are kept.  Its sum and its count are those of
    the rank's tokens, so over the cp ranks they add up to the whole sequence's.
    """

    def __init__(self, rank: int, size: int, ignore_index: int = -100) -> None:
        super().__init__(ignore_index)
        self.rank, self.size = rank, size

    def sum_and_count(
        self, logits: Tensor | tuple[Tensor, Tensor], labels: Tensor
    ) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
        if isinstance(logits, tuple) or not isinstance(logits, Tensor) or logits.dim() != 3:
            raise PipelineError(
                f"causal_lm_loss under context parallelism takes the last stage's logits "
                f"[batch, local seq, vocab], got {_shape(logits)}"
            )
        targets = self._targets(labels)
        if targets.shape != logits.shape[:2]:
            raise PipelineError(
                f"causal_lm_loss under context parallelism: the logits {list(logits.shape)} "
                f"are not cp rank {self.rank}'s {list(targets.shape)} of the labels "
                f"{list(labels.shape)}; shard every stage with zeropipe.parallelize(stages, "
                f"cp_mesh=mesh['cp'])"
            )
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        total = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return total, (targets != self.ignore_index).sum()

    def count(self, labels: Tensor) -> Tensor:
        """How many of this rank's tokens have a counted target."""
        return (self._targets(labels) != self.ignore_index).sum()

    def _targets(self, labels: Tensor) -> Tensor:
        """The shifted labels of this rank's tokens ``[batch, seq / cp]``."""
        super().count(labels)  # the shape checked
        shifted = torch.full_like(labels, self.ignore_index)
        shifted[:, :-1] = labels[:, 1:]
        return shifted[:, shard_indices(labels.shape[1], self.rank, self.size, labels.device)]

    def __repr__(self) -> str:
        return f"ShardedCausalLMLoss(rank={self.rank}, size={self.size})"


def _scalar(value: object) -> bool:
    return isinstance(value, Tensor) and value.dim() == 0 and value.is_floating_point()


def _shape(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__


causal_lm_loss = CausalLMLoss()
