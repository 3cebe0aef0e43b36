"""The shipped specs: accelerators (:class:`HardwareSpec`) and models, read from the JSON
files beside this module (``spec_data/``, each entry naming its source), and a model from
a Hugging Face ``config.json`` (:mod:`zeropipe.planning.hf_config`).

Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any

from zeropipe.core.errors import ScheduleError
from zeropipe.planning.hf_config import read_hf_config
from zeropipe.planning.pricing.transformer import ModelSpec

__all__ = ["HardwareSpec", "hardware_names", "load_hardware", "load_model", "model_names"]

_DATA = Path(__file__).with_name("spec_data")


@dataclass(frozen=True)
class HardwareSpec:
    """An accelerator and the links around it (bandwidths per GPU, one direction)."""

    name: str
    flops: dict[str, float]  # dtype -> dense peak FLOP/s
    memory: float  # bytes
    memory_bandwidth: float  # bytes/s
    gpus_per_node: int
    intra_bandwidth: float  # bytes/s between two GPUs of a node
    intra_latency: float  # seconds per message inside a node
    inter_bandwidth: float  # bytes/s of one GPU's share of the network
    inter_latency: float  # seconds per message across nodes
    host_bandwidth: float = 25e9  # bytes/s of a pinned copy to or from host memory
    source: str = ""

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise ScheduleError(
                f"{self.name} has no peak given for dtype {dtype!r}; known: "
                f"{', '.join(sorted(self.flops))}"
            )
        return self.flops[dtype]


def _read(kind: str) -> dict[str, dict[str, Any]]:
    data: dict[str, dict[str, Any]] = json.loads((_DATA / f"{kind}.json").read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


@cache
def _shipped(kind: str) -> dict[str, dict[str, Any]]:
    return _read(kind)


def model_names() -> list[str]:
    return sorted(_shipped("models"))


def hardware_names() -> list[str]:
    return sorted(_shipped("hardware"))


def load_model(name_or_path: str) -> ModelSpec:
    """A shipped model by name, or a Hugging Face ``config.json`` (a file or its folder)."""
    shipped = _shipped("models")
    if name_or_path.lower() in shipped:
        entry = shipped[name_or_path.lower()]
        return ModelSpec(name=name_or_path.lower(), **entry)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ScheduleError(
            f"unknown model {name_or_path!r}: give a Hugging Face config.json (file or folder) "
            f"or one of {', '.join(model_names())}"
        )
    shape = read_hf_config(path)
    try:
        return ModelSpec(**shape)
    except ScheduleError as exc:  # a shape that cannot be (heads and kv_heads, ...)
        raise ScheduleError(f"{path}: {exc}") from None


def load_hardware(name: str) -> HardwareSpec:
    shipped = _shipped("hardware")
    entry = shipped.get(name.lower())
    if entry is None:
        raise ScheduleError(f"unknown GPU {name!r}; known: {', '.join(hardware_names())}")
    known = {f.name for f in fields(HardwareSpec)}
    return HardwareSpec(name=name.lower(), **{k: v for k, v in entry.items() if k in known})
