"""Checkpoints that are never half-written, and never silently wrong when read back.

Layout under ``DIR``::

    DIR/step-000040/rank0.pt        each rank's stages, optimizer and RNG state
    DIR/step-000040/rank1.pt
    DIR/step-000040/manifest.json   the sha256 of every rank file, and the run's settings
    DIR/latest                      "step-000040": the newest *complete* checkpoint

Every file is written to a temporary name and renamed into place
(``os.replace`` is atomic on POSIX).  Each rank hashes the file it wrote;
rank 0 writes the manifest with every rank's hash once all files exist, and
only then moves ``latest``.  So a rank that dies while saving leaves the
previous checkpoint as ``latest``, intact, and a checkpoint is complete
exactly when its manifest exists.  Older checkpoints beyond ``keep`` are
removed after ``latest`` has moved.

Reading back (:func:`verify`, :func:`load_rank`) compares each file's sha256
with the manifest: a file changed on disk after it was written (a flipped
bit, a truncated copy, an edit) is refused with a :class:`CheckpointError`
that names it and the earlier checkpoints that still verify.  A loaded state
must also hold only finite floating-point values.  Checkpoints written before
manifests existed (no ``manifest.json``) are read unverified: :func:`verify`
returns ``None`` for them and the caller says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.errors import ZeropipeError

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "Manifest",
    "latest_step",
    "load_rank",
    "publish",
    "read_manifest",
    "save_rank",
    "sha256_of",
    "step_dir",
    "verify",
]

MANIFEST = "manifest.json"
_FORMAT = 1  # of the manifest; a reader refuses formats it does not know


class CheckpointError(ZeropipeError):
    """A checkpoint is missing, incomplete, unreadable or corrupt."""


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint promises: its step, each rank file's sha256, the run's settings.

    ``meta`` is whatever the writer passed to :func:`publish` (``zeropipe
    train`` stores its configuration under ``"config"``), as JSON.
    """

    step: int
    files: dict[str, str]  # file name -> sha256 hex digest
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ranks(self) -> int:
        return len(self.files)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def sha256_of(path: Path) -> str:
    """The sha256 hex digest of a file's bytes (read in chunks: checkpoints can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
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


def _text_writer(text: str) -> Callable[[Path], None]:
    def write(tmp: Path) -> None:
        tmp.write_text(text + "\n")

    return write


def save_rank(root: Path, step: int, rank: int, state: dict[str, Any]) -> str:
    """Write one rank's part of the checkpoint of ``step`` (atomically); return its sha256.

    The hash is of the bytes as written (read back from the temporary file
    before it is renamed), so what :func:`verify` later compares against is
    what reached the disk, not what was meant to.
    """
    path = step_dir(root, step) / _rank_file(rank)
    digest: list[str] = []

    def write(tmp: Path) -> None:
        torch.save(state, tmp)
        digest.append(sha256_of(tmp))

    _atomic_write(path, write)
    return digest[0]


def publish(
    root: Path,
    step: int,
    digests: Sequence[str],
    meta: Mapping[str, Any] | None = None,
    keep: int = 2,
) -> None:
    """Complete the checkpoint of ``step``: write its manifest, point ``latest`` at it, prune.

    ``digests[r]`` is what :func:`save_rank` returned on rank ``r``; ``meta``
    (JSON-serialisable) is stored in the manifest for whoever resumes.
    """
    folder = step_dir(root, step)
    missing = [r for r in range(len(digests)) if not (folder / _rank_file(r)).exists()]
    if not digests or missing:
        raise CheckpointError(
            f"checkpoint {folder} lacks rank file(s) {missing or [0]}; not publishing it"
        )
    record = {
        "format": _FORMAT,
        "step": step,
        "files": {_rank_file(r): d for r, d in enumerate(digests)},
        "meta": dict(meta or {}),
    }
    _atomic_write(folder / MANIFEST, _text_writer(json.dumps(record, indent=1, sort_keys=True)))
    _atomic_write(root / "latest", _text_writer(folder.name))
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


def _resolve(root: Path, step: int | None) -> int:
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(f"no checkpoint to resume from in {root} (no 'latest' file)")
    return step


def read_manifest(root: Path, step: int | None = None) -> Manifest | None:
    """The manifest of checkpoint ``step`` (default: ``latest``); None if it predates manifests."""
    step = _resolve(root, step)
    folder = step_dir(root, step)
    path = folder / MANIFEST
    if not path.exists():
        if not folder.is_dir():
            raise CheckpointError(f"{root / 'latest'} names {folder.name}, which does not exist")
        return None
    try:
        record = json.loads(path.read_text())
        if record.get("format") != _FORMAT:
            raise CheckpointError(
                f"{path} has format {record.get('format')!r}; this zeropipe reads format "
                f"{_FORMAT}: resume with the zeropipe that wrote it, or start a new --out"
            )
        files = {str(k): str(v) for k, v in record["files"].items()}
        return Manifest(int(record["step"]), files, dict(record.get("meta", {})))
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}; {_alternatives(root, step)}") from None


def _intact(root: Path, step: int) -> bool:
    """Whether checkpoint ``step`` has a manifest and every file it lists matches it."""
    try:
        manifest = read_manifest(root, step)
    except CheckpointError:
        return False
    folder = step_dir(root, step)
    return manifest is not None and all(
        (folder / name).exists() and sha256_of(folder / name) == digest
        for name, digest in manifest.files.items()
    )


def _alternatives(root: Path, bad: int) -> str:
    """What to do instead of resuming from checkpoint ``bad``: the earlier ones that verify."""
    good = [
        p.name
        for p in sorted(root.glob("step-*"), reverse=True)
        if p.is_dir() and p.name != step_dir(root, bad).name
        and p.name[5:].isdigit() and _intact(root, int(p.name[5:]))
    ]  # fmt: skip
    fresh = "start afresh with a new --out"
    if not good:
        return f"no other checkpoint in {root} verifies: {fresh}"
    return (
        f"resume from an earlier checkpoint that verifies ({', '.join(good)}: write its name "
        f"into {root / 'latest'}), or {fresh}"
    )


def _check_file(root: Path, step: int, name: str, expected: str) -> None:
    path = step_dir(root, step) / name
    if not path.exists():
        raise CheckpointError(f"{path} is missing; {_alternatives(root, step)}")
    if sha256_of(path) != expected:
        raise CheckpointError(
            f"{path} is corrupt (its sha256 differs from the one recorded when it was saved); "
            f"{_alternatives(root, step)}"
        )


def verify(root: Path, step: int | None = None) -> Manifest | None:
    """Check every rank file of checkpoint ``step`` (default: ``latest``) against its manifest.

    Returns the manifest, or None for a checkpoint written before manifests
    existed (nothing to check it against).  Raises :class:`CheckpointError`
    naming the first file that is missing or differs.
    """
    step = _resolve(root, step)
    manifest = read_manifest(root, step)
    if manifest is not None:
        for name, digest in sorted(manifest.files.items()):
            _check_file(root, step, name, digest)
    return manifest


def _non_finite(value: Any, where: str) -> str | None:
    """The key path of the first floating-point tensor in ``value`` with a NaN or inf."""
    if isinstance(value, torch.Tensor):
        bad = value.is_floating_point() and not bool(torch.isfinite(value).all())
        return where if bad else None
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, f"{where}/{key}" if where else str(key))
        if found is not None:
            return found
    return None


def load_rank(root: Path, rank: int, step: int | None = None) -> dict[str, Any]:
    """One rank's state from checkpoint ``step`` (default: ``latest``), verified.

    The file's sha256 must match the manifest (when the checkpoint has one)
    and every floating-point tensor in it must be finite.  Tensors are loaded
    onto the CPU; ``load_state_dict`` moves them to where the model lives.
    """
    step = _resolve(root, step)
    path = step_dir(root, step) / _rank_file(rank)
    manifest = read_manifest(root, step)
    if not path.exists():
        saved = f" (it was saved with --ranks {manifest.ranks})" if manifest else ""
        raise CheckpointError(
            f"{path} does not exist{saved}; was the run saved with a different --ranks?"
        )
    if manifest is not None:
        if path.name not in manifest.files:
            raise CheckpointError(
                f"{path} is not in {MANIFEST} (it lists {manifest.ranks} rank files); "
                f"was the run saved with a different --ranks?"
            )
        _check_file(root, step, path.name, manifest.files[path.name])
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"cannot read {path}: {first}; {_alternatives(root, step)}") from exc
    where = _non_finite(state, "")
    if where is not None:
        raise CheckpointError(
            f"{path} holds non-finite values (in {where}); {_alternatives(root, step)}"
        )
    return state
