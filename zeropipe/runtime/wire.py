"""The transfer header: what teaches both ends of a cross-rank transfer its tensors.

A boundary transfer is a tuple of tensors whose shapes and dtypes the
receiver cannot know in advance.  On its first use the sender sends a
fixed-size int64 header before the payload::

    [count, dtype code, ndim, d0, d1, ..., dtype code, ndim, d0, ..., 0, 0, ...]
     <------------------------------ HEADER_LEN words ---------------------->

Both sides remember the decoded :data:`Meta`; later steps send the payload
alone.  Each transfer owns :data:`SLOTS` consecutive tags: slot 0 for the
header, slot k + 1 for tensor k.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action

__all__ = [
    "DTYPES",
    "HEADER_LEN",
    "MAX_TAG",
    "ORDERED_TAGS",
    "SLOTS",
    "TAGGED_TAGS",
    "Meta",
    "decode_header",
    "describe_meta",
    "dtype_code",
    "encode_header",
    "meta_of",
]

# Header: [count, (dtype code, ndim, d0, d1, ...) per tensor], zero padded.
HEADER_LEN = 64
# Tags per transfer: the header, then one per tensor of the tuple.
SLOTS = 32
# Tags start high (plain send/recv elsewhere, a profiler or user code, use small ones), the
# tagged protocol's from TAGGED_TAGS up, the ordered protocol's (one per pipeline) below it.
ORDERED_TAGS = 1 << 23
TAGGED_TAGS = 1 << 24
MAX_TAG = 2**31 - 1

# The dtypes a transfer can carry; a dtype's code is its index here.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_CODE = {d: k for k, d in enumerate(DTYPES)}

Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
"""(dtype, shape) of each tensor of a transfer."""


def dtype_code(dtype: torch.dtype) -> int | None:
    """The header code of ``dtype``, or None if transfers cannot carry it."""
    return _CODE.get(dtype)


def describe_meta(meta: Meta) -> str:
    """``float32[4, 8], int64[4]``: a transfer's tensors, for messages."""
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(s)}" for d, s in meta)


def meta_of(tensors: Sequence[Tensor]) -> Meta:
    """The (dtype, shape) of each tensor."""
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def encode_header(meta: Meta, action: Action, device: torch.device) -> Tensor:
    """The header tensor describing ``meta`` (``action`` names the transfer in errors)."""
    words = [len(meta)]
    for dtype, shape in meta:
        if dtype not in _CODE:
            raise PipelineError(f"{action}: cannot send a {dtype} tensor across ranks")
        words += [_CODE[dtype], len(shape), *shape]
    if len(meta) >= SLOTS or len(words) > HEADER_LEN:
        raise PipelineError(
            f"{action}: {len(meta)} boundary tensor(s) of {sum(len(s) for _, s in meta)} dims "
            f"exceed the transfer header ({SLOTS - 1} tensors, {HEADER_LEN} words); "
            f"pack the stage's outputs into fewer tensors"
        )
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return header.to(device)


def decode_header(header: Tensor, action: Action) -> Meta:
    """The :data:`Meta` a received header describes."""
    words = header.cpu().tolist()
    try:
        count, k, meta = words[0], 1, []
        for _ in range(count):
            dtype, ndim = DTYPES[words[k]], words[k + 1]
            meta.append((dtype, tuple(words[k + 2 : k + 2 + ndim])))
            k += 2 + ndim
    except IndexError:
        raise PipelineError(f"{action}: malformed transfer header {words}") from None
    return tuple(meta)
