"""Checkpoints that are never half-written, and never silently wrong when read back.

Layout under ``DIR``::

    DIR/step-000040/                a DCP checkpoint (zeropipe.runtime.checkpoint.dcp):
        __0_0.distcp, __1_0.distcp  each rank's stages and optimizer state, by name
        .metadata                   DCP's index of every key
        manifest.json               the sha256 of every file, and the run's settings
    DIR/latest                      "step-000040": the newest *complete* checkpoint

A checkpoint folder is written under a temporary name and renamed into place
once every rank's files and the manifest exist (:func:`save_checkpoint`);
only then does rank 0 move ``latest`` (:func:`point_latest`).  So a rank that
dies while saving leaves the previous checkpoint as ``latest``, intact, and a
checkpoint is complete exactly when its manifest exists.  Older checkpoints
beyond ``keep`` are removed after ``latest`` has moved.

Checkpoints of the older format (manifest format 1, or none) hold one
``rankN.pt`` per rank, each written to a temporary name and renamed
(:func:`save_rank`, :func:`publish`); they are still read (:func:`load_rank`),
on the layout that saved them only.

:func:`export_safetensors` turns a DCP checkpoint's model into one
safetensors file, in one process.

Reading back (:func:`verify`, :func:`load_rank`) compares each file's sha256
with the manifest: a file changed on disk after it was written (a flipped
bit, a truncated copy, an edit) is refused with a :class:`CheckpointError`
that names it and the earlier checkpoints that still verify.  A loaded state
must also hold only finite floating-point values.  Checkpoints written before
manifests existed (no ``manifest.json``) are read unverified: :func:`verify`
returns ``None`` for them and the caller says so.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeropipe.apps.export_target import check_target
from zeropipe.core.errors import ZeropipeError
from zeropipe.runtime.checkpoint.dcp import consolidated_state_dict, save_checkpoint
from zeropipe.runtime.checkpoint.folder import FORMAT as DCP_FORMAT
from zeropipe.runtime.checkpoint.folder import MANIFEST, CheckpointError, sha256_of
from zeropipe.runtime.checkpoint.names import is_lead
from zeropipe.runtime.pipeline import Pipeline

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "Manifest",
    "checkpoint_folder",
    "export_safetensors",
    "latest_step",
    "load_rank",
    "newest_complete",
    "point_latest",
    "publish",
    "read_manifest",
    "save_rank",
    "save_step",
    "sha256_of",
    "step_dir",
    "verify",
]

_FORMAT = 1  # of the per-rank files' manifest; DCP checkpoints' is DCP_FORMAT


@dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint promises: its step, each file's sha256, the run's settings.

    ``meta`` is whatever the writer passed to :func:`publish` / :func:`save_step`
    (``zeropipe train`` stores its configuration under ``"config"``), as JSON.
    ``format``: 1 for per-rank ``rankN.pt`` files, 2 for a DCP checkpoint.
    """

    step: int
    files: dict[str, str]  # file name -> sha256 hex digest
    meta: dict[str, Any] = field(default_factory=dict)
    format: int = _FORMAT

    @property
    def ranks(self) -> int:
        return len(self.files)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


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
    point_latest(root, step, keep)


def point_latest(root: Path, step: int, keep: int = 2) -> None:
    """Point ``latest`` at the complete checkpoint of ``step``; remove all but the ``keep`` newest.

    Only folders named as :func:`step_dir` names them are the run's to remove: a user's
    ``step-000002-keep`` or ``step-000050.bak`` beside them stays.
    """
    folder = step_dir(root, step)
    _atomic_write(root / "latest", _text_writer(folder.name))
    for old in _step_folders(root)[keep:] if keep > 0 else []:
        if old != step:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)


def save_step(
    root: Path,
    step: int,
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    *,
    extra: Any,
    meta: Mapping[str, Any],
    model: torch.nn.Module | None = None,
    keep: int = 2,
) -> None:
    """Save the checkpoint of ``step`` in DCP format (every rank calls it), then move ``latest``.

    ``meta`` (JSON) goes into the manifest with the step; ``extra`` (any
    picklable object) into the checkpoint, returned on load.
    """
    save_checkpoint(
        pipe,
        optimizer,
        step_dir(root, step),
        extra=extra,
        meta={**meta, "step": step},
        model=model,
    )
    if is_lead(pipe):  # one process: under --tp every process of pipeline rank 0 is rank 0
        point_latest(root, step, keep)


def checkpoint_folder(source: Path, note: Callable[[str], None] | None = None) -> Path:
    """The DCP checkpoint folder ``source`` names: itself (it has a manifest), the newest
    complete one of ``source`` or of ``source/checkpoints`` (a train --out) -- the one their
    ``latest`` names, or, without it, the one :func:`newest_complete` finds, which ``note``
    is told why (e.g. "DIR/latest is missing")."""
    if (source / MANIFEST).exists():
        return source
    for root in (source, source / "checkpoints"):
        if (root / "latest").exists() or _step_folders(root):
            step, why = newest_complete(root)
            if why is not None and note is not None:
                note(why)
            return step_dir(root, _resolve(root, step))
    raise CheckpointError(
        f"{source} is not a checkpoint: it has no {MANIFEST}, no 'latest' and no "
        f"checkpoints/latest; give a step-NNNNNN folder, a checkpoints folder or a train --out"
    )


def export_safetensors(source: Path, out: Path, force: bool = False) -> tuple[Path, int]:
    """Write the model of the DCP checkpoint ``source`` (see :func:`checkpoint_folder`) to one
    safetensors file ``out``; return the folder read and the number of tensors written.

    Keys are the model's ``state_dict`` keys.  A tied tensor is written under
    each of its names, as separate copies (safetensors refuses shared
    storage), so ``model.load_state_dict(safetensors.torch.load_file(out))``
    loads it strictly; the copies are equal, and loading into a model whose
    weights are tied leaves them tied.  Needs no process group.

    An existing ``out`` is replaced only with ``force``, and never one in a run's
    checkpoints (:func:`zeropipe.apps.export_target.check_target`).  ``out`` is
    written to a temporary file beside it and renamed over it, so a failed export
    leaves an existing ``out`` as it was; it gets the permissions a new file gets
    (0666 less the umask), not safetensors' 0600.
    """
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ZeropipeError(
            f"cannot export to {out}: {above} is a file, not a folder; name a file in a folder"
        )
    folder = checkpoint_folder(source)
    check_target(out, folder, force, folder_form=False)
    try:
        from safetensors import SafetensorError
        from safetensors.torch import save_file
    except ImportError:
        raise ZeropipeError(
            "zeropipe export writes safetensors, which is not installed: pip install 'zeropipe[hf]'"
        ) from None
    tensors, aliases = consolidated_state_dict(folder)
    full = dict(tensors)
    for alias, name in aliases.items():
        full[alias] = tensors[name].clone()
    written = {k: v.contiguous() for k, v in sorted(full.items())}

    def write(tmp: Path) -> None:
        # The kernel applies the umask to a file it creates; safetensors then makes
        # the file 0600, so the mode is read here and put back after it.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = tmp.stat().st_mode & 0o777
        save_file(
            written,
            str(tmp),
            metadata={"format": "pt", "tied": json.dumps(aliases, sort_keys=True)},
        )
        os.chmod(tmp, mode)

    try:
        _atomic_write(out, write)
    except (OSError, SafetensorError) as exc:
        text = str(exc).strip()
        why = getattr(exc, "strerror", None) or (text.splitlines()[0] if text else repr(exc))
        raise ZeropipeError(
            f"cannot export to {out}: {why}; name a file in a folder you can write"
        ) from None
    return folder, len(full)


def latest_step(root: Path) -> int | None:
    """The step of the newest complete checkpoint (:func:`newest_complete`), or None if
    there is none."""
    return newest_complete(root)[0]


def newest_complete(root: Path) -> tuple[int | None, str | None]:
    """The step of the newest complete checkpoint in ``root``, and why it is not the one
    ``latest`` names (None when it is).

    ``latest`` is written last, so it names the newest complete checkpoint; when it is
    missing (deleted, or lost with a disk) or names a folder that is gone, the newest
    step-NNNNNN folder whose files verify against its manifest is the one instead.
    ``(None, None)``: neither.  A dangling name with no folder to take instead is returned
    as it is, so that reading it says the folder is gone.
    """
    pointer = root / "latest"
    named = None
    if pointer.exists():
        name = pointer.read_text().strip()
        try:
            named = int(name.removeprefix("step-"))
        except ValueError:
            raise CheckpointError(f"{pointer} names {name!r}, not a step-NNNNNN folder") from None
        if step_dir(root, named).is_dir():
            return named, None
    found = next((step for step in _step_folders(root) if _intact(root, step)), None)
    if found is None:
        return named, None
    why = (
        "is missing"
        if named is None
        else f"names {step_dir(root, named).name}, which does not exist"
    )
    return found, f"{pointer} {why}"


def _step_folders(root: Path) -> list[int]:
    """The steps of the folders in ``root`` named as :func:`step_dir` names them, newest
    first (a ``step-2`` or ``step-000002.bak`` is someone else's)."""
    steps = []
    for path in root.glob("step-*"):
        digits = path.name.removeprefix("step-")
        canonical = digits.isascii() and digits.isdigit()
        if canonical and path.name == step_dir(root, int(digits)).name and path.is_dir():
            steps.append(int(digits))
    return sorted(steps, reverse=True)


def _resolve(root: Path, step: int | None) -> int:
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointError(
                f"no checkpoint to resume from in {root} (no 'latest' file, and no "
                f"step-NNNNNN folder in it verifies)"
            )
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
        form = record.get("format")
        if form not in (_FORMAT, DCP_FORMAT):
            raise CheckpointError(
                f"{path} has format {form!r}; this zeropipe reads formats {_FORMAT} and "
                f"{DCP_FORMAT}: resume with the zeropipe that wrote it, or start a new --out"
            )
        files = {str(k): str(v) for k, v in record["files"].items()}
        meta = dict(record.get("meta", {}))
        saved = record["step"] if form == _FORMAT else meta.get("step", step)
        return Manifest(int(saved), files, meta, int(form))
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
