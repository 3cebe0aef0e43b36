"""Documents packed into rows, masked apart: what a model is fed of a window of several.

A window of ``--data`` tokens holds the end of one document, whole ones, and the start of
another, each followed by the end-of-text token.  Fed as is, attention crosses from one
document into the next (GPT-2's pretraining did so, the separator telling the model that
what follows is unrelated).  :func:`packed_rows` feeds a Hugging Face model the rows with
position ids that restart at each document instead: the model, and a split one's every
stage, then masks documents apart (transformers reads packed rows from the position ids),
and each document's first token is labelled -100, so nothing predicts it from the one
before.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["document_positions", "packed_rows"]


def document_positions(ids: Tensor, eos: int) -> Tensor:
    """Position ids ``[batch, seq]`` that restart after every ``eos`` in each row of ``ids``
    (a row's first token starts a document too)."""
    starts = torch.zeros_like(ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = ids[:, :-1] == eos
    index = torch.arange(ids.shape[1]).expand_as(ids)
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start


def packed_rows(ids: Tensor, eos: int) -> tuple[dict[str, Tensor], Tensor]:
    """A Hugging Face model's inputs ``{"input_ids", "position_ids"}`` for rows ``ids`` of
    documents each ended by ``eos``, and its labels (the ids, -100 at each document's start)."""
    pos = document_positions(ids, eos)
    return {"input_ids": ids, "position_ids": pos}, ids.masked_fill(pos == 0, -100)
