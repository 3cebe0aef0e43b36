"""A checkpoint folder on disk: written whole or not at all, verified, recovered.

:func:`zeropipe.runtime.checkpoint.dcp.save_checkpoint` has DCP write every rank's files
into ``.<name>.partial`` beside ``path``; rank 0 then writes ``manifest.json`` (the
sha256 of every file, the caller's ``meta``, the aliases, the optimizer's class) and
renames the folder into place (:func:`publish`), moving a checkpoint it replaces to
``.<name>.old`` for the moment of the swap.  A path that holds anything other than a
checkpoint is refused before anything moves (:func:`not_a_checkpoint`).  Reading
one back checks every file against the manifest (:func:`verify_checkpoint`); when a
re-save was killed between its two renames, :func:`recovered` finds the newest
complete folder it left.  :func:`cannot_save` says in one line why a save failed and
what to do.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zeropipe.core.errors import ZeropipeError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "CheckpointError",
    "cannot_save",
    "files_of",
    "fsync_dir",
    "not_a_checkpoint",
    "old_path",
    "os_error",
    "partial_path",
    "publish",
    "read_checkpoint_manifest",
    "recovered",
    "sha256_of",
    "verifies",
    "verify_checkpoint",
    "what_is_left",
    "why_failed",
]


MANIFEST = "manifest.json"


FORMAT = 2  # of the manifest (1: zeropipe train's older per-rank .pt files)


class CheckpointError(ZeropipeError):
    """A checkpoint is missing, incomplete, unreadable, corrupt, or does not fit the model."""


def sha256_of(path: Path) -> str:
    """The sha256 hex digest of a file's bytes (read in chunks: checkpoints can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial")


def old_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.old")


def os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: itself, or one it was raised from or while handling."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


_WRITABLE = "save to a writable folder with free space"


_FIXES = {
    errno.ENOSPC: "free space there, or save elsewhere",
    errno.EDQUOT: "free space there (the disk quota is used up), or save elsewhere",
    errno.EACCES: "make the folder writable, or save elsewhere",
    errno.EPERM: "make the folder writable, or save elsewhere",
    errno.EROFS: "the file system is read-only: save elsewhere",
    errno.ENOTDIR: "a part of the path is a file, not a folder: save elsewhere",
    errno.EEXIST: "a part of the path is a file, not a folder: save elsewhere",
}


def why_failed(exc: BaseException, rank: int | None) -> tuple[str, str | None]:
    """What went wrong, in one line (the OSError under ``exc`` if any), and how to fix it."""
    cause = os_error(exc)
    if cause is not None and cause.strerror:
        why = cause.strerror[:1].lower() + cause.strerror[1:]  # "no space left on device"
        if cause.filename:
            why += f" ({cause.filename})"
        fix: str | None = _FIXES.get(cause.errno or 0, _WRITABLE)
    else:
        text = str(exc).strip()
        why = text.splitlines()[0] if text else type(exc).__name__
        # Not the disk: advice about free space would mislead.
        fix = _UNPICKLABLE if isinstance(exc, pickle.PickleError) or "pickle" in text else None
    return why + ("" if rank is None else f" on rank {rank}"), fix


_UNPICKLABLE = (
    "extra= (and any non-tensor optimizer state) must be picklable: pass plain data, "
    "not lambdas, local functions or open files"
)


def cannot_save(path: Path, exc: BaseException, rank: int | None = None) -> str:
    why, fix = why_failed(exc, rank)
    return f"cannot save checkpoint {path}: {why}" + ("" if fix is None else f"; {fix}")


def not_a_checkpoint(path: Path) -> str | None:
    """Why ``path`` must not be saved over: it holds something other than a checkpoint,
    which the re-save's rename would move aside and the next one delete."""
    if not os.path.lexists(path) or (path / MANIFEST).is_file():
        return None
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        return None  # an empty folder: nothing to lose
    what = "a file, not a checkpoint" if path.is_file() else "not a checkpoint"
    return (
        f"cannot save checkpoint {path}: it exists and is {what} (no {MANIFEST}); "
        f"save to a new path or remove it"
    )


def files_of(folder: Path) -> dict[str, str]:
    return {
        p.relative_to(folder).as_posix(): sha256_of(p)
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(
    tmp: Path,
    path: Path,
    meta: Mapping[str, Any],
    aliases: dict[str, str],
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Rank 0, once every rank's files are in ``tmp``: the manifest, then the rename."""
    record = {
        "format": FORMAT,
        "layout": "torch.distributed.checkpoint",
        "files": files_of(tmp),
        "aliases": aliases,
        "meta": dict(meta),
        # None: saved without one (the model only); a load with an optimizer is refused
        "optimizer": None if optimizer is None else type(optimizer).__name__,
    }
    manifest = tmp / MANIFEST
    with open(manifest, "w") as fh:
        fh.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(tmp)
    old = old_path(path)
    moved = path.exists()
    if moved:  # re-saving a step a killed run had saved: it was never `latest`
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except OSError:
        if moved:  # the checkpoint being replaced goes back where it was
            os.replace(old, path)
        raise
    fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def read_checkpoint_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint folder ``path`` (files, aliases, meta), unverified."""
    path = Path(path)
    file = path / MANIFEST
    if not file.exists():
        raise CheckpointError(f"{path} is not a complete checkpoint: {what_is_left(path)}")
    try:
        record: dict[str, Any] = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from None
    if record.get("format") != FORMAT:
        raise CheckpointError(
            f"{file} has format {record.get('format')!r}, not {FORMAT} (a DCP checkpoint); "
            f"read it with the zeropipe that wrote it"
        )
    return record


def what_is_left(path: Path) -> str:
    """Why ``path`` has no manifest, and what a failed save left beside it."""
    complete = [p for p in (partial_path(path), old_path(path)) if (p / MANIFEST).exists()]
    if not path.exists() and complete:
        return (
            f"it does not exist; a save killed between its two renames left "
            f"{' and '.join(str(p) for p in complete)} beside it: load_checkpoint loads "
            f"the newest that verifies, or rename that one to {path}"
        )
    why = f"it has no {MANIFEST}"
    if partial_path(path).exists():
        why += " (a save was interrupted: its .partial folder is not a checkpoint)"
    return why


def recovered(path: Path) -> tuple[Path, dict[str, Any]]:
    """``path`` and its verified manifest; or, where a save was killed between its two
    renames and left no folder at ``path``, the newest complete one it left, with a warning."""
    if not path.exists():
        failed: list[str] = []
        for folder in (partial_path(path), old_path(path)):  # newest first
            if not (folder / MANIFEST).exists():
                continue  # not one: a save died before its manifest
            try:
                record = verify_checkpoint(folder)
            except CheckpointError as exc:
                failed.append(str(exc))
                continue
            warnings.warn(
                f"{path} does not exist (a save was killed between its two renames); "
                f"loading {folder}, the newest complete checkpoint it left: rename it to "
                f"{path} to keep it",
                stacklevel=3,
            )
            return folder, record
        if failed:
            raise CheckpointError(
                f"{path} does not exist, and what a killed save left beside it does not "
                f"verify: {'; '.join(failed)}"
            )
    return path, verify_checkpoint(path)


def verifies(path: Path) -> bool:
    if not (path / MANIFEST).exists():
        return False
    try:
        verify_checkpoint(path)
    except CheckpointError:
        return False
    return True


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every file of checkpoint ``path`` against its manifest; return the manifest."""
    path = Path(path)
    record = read_checkpoint_manifest(path)
    for name, digest in sorted(record["files"].items()):
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file} is missing (the manifest lists it)")
        if sha256_of(file) != digest:
            raise CheckpointError(
                f"{file} is corrupt (its sha256 differs from the one recorded when it was saved)"
            )
    return record
