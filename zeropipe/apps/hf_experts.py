"""Mixture-of-experts weights as Hugging Face folders hold them and as transformers 5 models do.

A transformers 5 MoE layer keeps its experts in two 3-D parameters, but
``save_pretrained`` writes (and checkpoints on the Hub hold) one tensor per
expert and projection, as transformers' ``conversion_mapping`` converts them
(checked on 5.24)::

    the model's parameter               on disk, for each expert e = 0 .. E-1
    L.mlp.experts.gate_up_proj [E,2I,H]  L.mlp.experts.e.gate_proj.weight [I,H], then up_proj's
    L.mlp.experts.down_proj    [E,H,I]   L.mlp.experts.e.down_proj.weight [H,I]

    Mixtral: ``.block_sparse_moe.`` on disk for the model's ``.mlp.``, and w1 (gate),
    w3 (up), w2 (down) for the projections.

``zeropipe train --model-path`` reads either layout (:func:`disk_parts`, then
:func:`fused`); ``zeropipe export`` writes the one ``save_pretrained`` writes
(:func:`to_disk`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["disk_name", "disk_parts", "fused", "to_disk"]

# model_type -> (the model's name for the MoE block, the disk's, (gate, up, down) on disk)
_LAYOUTS: dict[str, tuple[str, str, tuple[str, str, str]]] = {
    "qwen3_moe": (".mlp.", ".mlp.", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": (".mlp.", ".mlp.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": (".mlp.", ".block_sparse_moe.", ("w1", "w3", "w2")),
}
_FUSED = re.compile(r"^(?P<layer>.*)\.experts\.(?P<which>gate_up_proj|down_proj)$")


def disk_name(model_type: str, key: str) -> str:
    """The name a tensor stored whole has on disk (Mixtral renames its MoE block)."""
    layout = _LAYOUTS.get(model_type)
    if layout is None or layout[0] == layout[1]:
        return key
    return key.replace(layout[0], layout[1])


def disk_parts(model_type: str, key: str, experts: int) -> list[list[str]] | None:
    """The on-disk names the fused parameter ``key`` is made of (one list per projection,
    one name per expert), or None when ``key`` is no fused experts' parameter."""
    layout = _LAYOUTS.get(model_type)
    found = _FUSED.match(key)
    if layout is None or found is None:
        return None
    layer = disk_name(model_type, found["layer"] + ".")
    gate, up, down = layout[2]
    names = (gate, up) if found["which"] == "gate_up_proj" else (down,)
    return [[f"{layer}experts.{e}.{n}.weight" for e in range(experts)] for n in names]


def fused(parts: list[list[Tensor]]) -> Tensor:
    """The fused parameter from its per-expert tensors: stacked over experts, gate and up
    concatenated along the projection's output dim."""
    return torch.cat([torch.stack(p) for p in parts], dim=1)


def to_disk(model_type: str, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (the model's names) as ``save_pretrained`` writes it: fused experts split
    into one tensor per expert and projection, Mixtral's MoE block renamed."""
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        names = disk_parts(model_type, key, t.shape[0])
        if names is None:
            out[disk_name(model_type, key)] = t
            continue
        pieces = t.chunk(len(names), dim=1)  # gate then up, or down whole
        for group, piece in zip(names, pieces, strict=True):
            for e, name in enumerate(group):
                out[name] = piece[e].contiguous()
    return out
