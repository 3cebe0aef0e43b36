"""Checkpoints that are never half-written.

Layout under ``DIR``::

    DIR/step-000040/rank0.pt   each rank's stages, optimizer and RNG state
    DIR/step-000040/rank1.pt
    DIR/latest                 "step-000040": the newest *complete* checkpoint

Every file is written to a temporary name and renamed into place
(``os.replace`` is atomic on POSIX).  ``latest`` moves only after every
rank's file exists, so a rank that dies while saving leaves the previous
checkpoint as ``latest``, intact.  Older checkpoints beyond ``keep`` are
removed after ``latest`` has moved.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from zeropipe.errors import ZeropipeError

__all__ = ["CheckpointError", "latest_step", "load_rank", "publish", "save_rank", "step_dir"]


class CheckpointError(ZeropipeError):
    """A checkpoint is missing, incomplete or unreadable."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _atomic_write(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_rank(root: Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    """Write one rank's part of the checkpoint of ``step`` (atomically)."""
    path = step_dir(root, step) / f"rank{rank}.pt"
    _atomic_write(path, lambda tmp: torch.save(state, tmp))
    return path


def publish(root: Path, step: int, ranks: int, keep: int = 2) -> None:
    """Point ``latest`` at ``step`` once all ``ranks`` files exist; prune old ones."""
    folder = step_dir(root, step)
    missing = [r for r in range(ranks) if not (folder / f"rank{r}.pt").exists()]
    if missing:
        raise CheckpointError(
            f"checkpoint {folder} lacks rank file(s) {missing}; not publishing it"
        )
    _atomic_write(root / "latest", lambda tmp: Path(tmp).write_text(folder.name + "\n"))
    steps = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


def latest_step(root: Path) -> int | None:
    """The step of the newest complete checkpoint, or None if there is none."""
    pointer = root / "latest"
    if not pointer.exists():
        return None
    name = pointer.read_text().strip()
    try:
        return int(name.removeprefix("step-"))
    except ValueError:
        raise CheckpointError(f"{pointer} names {name!r}, not a step-NNNNNN folder") from None


def load_rank(root: Path, rank: int, step: int | None = None) -> dict[str, Any]:
    """One rank's state from checkpoint ``step`` (default: ``latest``)."""
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(f"no checkpoint to resume from in {root} (no 'latest' file)")
    path = step_dir(root, step) / f"rank{rank}.pt"
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; was the run saved with a different --ranks?")
    try:
        state: dict[str, Any] = torch.load(path, weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return state
