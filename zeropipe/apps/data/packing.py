"""Documents packed into rows, masked apart: what a model is fed of a window of several.

A window of ``--data`` tokens holds the end of one document, whole ones, and the start of
another, each followed by the end-of-text token.  Fed as is, attention crosses from one
document into the next (GPT-2's pretraining did so, the separator telling the model that
what follows is unrelated).  :func:`packed_rows` feeds a Hugging Face model the rows with
position ids that restart at each document instead: the model, and a split one's every
stage, then masks documents apart (transformers reads packed rows from the position ids),
and each document's first token is labelled -100, so nothing predicts it from the one
before.

Documents of many lengths can also be fed without packing them into rows of one length:
:func:`pack_documents` packs whole documents into rows of a given length (position ids
restarting at each); :func:`token_budget_microbatches` sorts them by length and cuts them
into a step's microbatches of about equal padded token counts, each padded only to its own
longest row (a :class:`~zeropipe.runtime.step.stage.Microbatches`, each its own shape);
:func:`token_scale` is their sizes as a cost model's ``microbatch_scale``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from zeropipe.core.errors import ZeropipeError
from zeropipe.runtime.step.stage import Microbatches, as_tuple, batch_names

__all__ = [
    "document_positions",
    "pack_documents",
    "packed_rows",
    "token_budget_microbatches",
    "token_scale",
]

IGNORE = -100  # the label of a token nothing is trained to predict (pads, document starts)


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


def _check_documents(docs: Sequence[Tensor], at_least: int, what: str) -> None:
    if len(docs) < at_least:
        raise ZeropipeError(f"{len(docs)} document(s) cannot fill {at_least} {what}")
    for k, doc in enumerate(docs):
        if not isinstance(doc, Tensor) or doc.dim() != 1 or len(doc) == 0:
            raise ZeropipeError(f"document {k} must be a non-empty 1-d tensor of token ids")


def pack_documents(
    docs: Sequence[Tensor], seq: int, *, pad: int = 0
) -> tuple[dict[str, Tensor], Tensor]:
    """Whole documents packed into rows of ``seq`` tokens, longest first, each into the first
    row with room (first-fit decreasing): ``({"input_ids", "position_ids"}, labels)``.

    Position ids restart at each document (a Hugging Face model then masks documents
    apart); a row's unused tail is pads, a document of its own, labelled -100, as is each
    document's first token (nothing predicts it from the one before).
    """
    _check_documents(docs, 1, "rows")
    longest = max(len(d) for d in docs)
    if longest > seq:
        raise ZeropipeError(f"a document of {longest} tokens does not fit rows of {seq}")
    rows: list[list[Tensor]] = []
    room: list[int] = []
    for doc in sorted(docs, key=len, reverse=True):
        first = next((r for r, left in enumerate(room) if left >= len(doc)), len(rows))
        if first == len(rows):
            rows.append([])
            room.append(seq)
        rows[first].append(doc)
        room[first] -= len(doc)
    ids = torch.full((len(rows), seq), pad, dtype=torch.int64)
    pos = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for r, row in enumerate(rows):
        at = 0
        for doc in row:
            ids[r, at : at + len(doc)] = doc
            pos[r, at : at + len(doc)] = torch.arange(len(doc))
            labels[r, at + 1 : at + len(doc)] = doc[1:]
            at += len(doc)
        pos[r, at:] = torch.arange(seq - at)
    return {"input_ids": ids, "position_ids": pos}, labels


def token_budget_microbatches(
    docs: Sequence[Tensor], microbatches: int, *, pad: int = 0, positions: bool = False
) -> Microbatches:
    """Documents sorted by length and cut into ``microbatches`` of about equal padded token
    counts (rows x the microbatch's longest row), each padded only to its own longest row.

    One row per document, right-padded with ``pad`` (labelled -100, so under causal
    attention no counted token sees a pad).  Sorted, documents of like length share a
    microbatch, so little is padding; the cut is the contiguous one whose largest
    microbatch is smallest.  Inputs are the token ids, or with ``positions`` the dict
    ``{"input_ids", "position_ids"}`` a split Hugging Face model takes; targets the labels.
    """
    _check_documents(docs, microbatches, "microbatches")
    ordered = sorted(docs, key=len, reverse=True)
    groups = _cut_by_budget([len(d) for d in ordered], microbatches)
    inputs: list[Tensor | dict[str, Tensor]] = []
    targets = []
    start = 0
    for count in groups:
        group = ordered[start : start + count]
        start += count
        width = len(group[0])  # the longest: sorted longest first
        ids = torch.full((count, width), pad, dtype=torch.int64)
        labels = torch.full_like(ids, IGNORE)
        for r, doc in enumerate(group):
            ids[r, : len(doc)] = doc
            labels[r, : len(doc)] = doc
        pos = torch.arange(width).expand(count, width)
        inputs.append({"input_ids": ids, "position_ids": pos.clone()} if positions else ids)
        targets.append(labels)
    return Microbatches(inputs=inputs, targets=targets)


def _cut_by_budget(lengths: Sequence[int], parts: int) -> list[int]:
    """How many of ``lengths`` (longest first) each of ``parts`` contiguous groups takes, so
    that the largest group's padded tokens (its rows x its first length) are fewest."""

    def fill(budget: int) -> list[int]:
        groups: list[int] = []
        at = 0
        while at < len(lengths):
            width, rows = lengths[at], 0
            while at + rows < len(lengths) and (rows + 1) * width <= budget:
                rows += 1
            groups.append(max(rows, 1))
            at += groups[-1]
        return groups

    low, high = max(lengths), len(lengths) * max(lengths)
    while low < high:  # the least budget that needs no more than ``parts`` groups
        mid = (low + high) // 2
        if len(fill(mid)) <= parts:
            high = mid
        else:
            low = mid + 1
    groups = fill(low)
    while len(groups) < parts:  # fewer groups than parts: halve the one of most rows
        k = max(range(len(groups)), key=lambda g: groups[g])
        groups[k : k + 1] = [groups[k] - groups[k] // 2, groups[k] // 2]
    return groups


def token_scale(batches: Microbatches) -> tuple[float, ...]:
    """Each microbatch's padded tokens (the elements of its first input: rows x length for
    token ids) over their mean:
    ``CostModel(..., microbatch_scale=token_scale(batches))`` prices a step of them, each
    microbatch's compute, memory and boundary bytes in proportion to its tokens (attention's
    share, which grows with the square of the length, is priced linearly)."""
    tokens = [float(as_tuple(batch_names(x)[1], "inputs")[0].numel()) for x in batches.inputs]
    mean = sum(tokens) / len(tokens)
    return tuple(t / mean for t in tokens)
