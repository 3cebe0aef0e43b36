"""What ``zeropipe export`` may write over: never what it did not write.

    check_target(out, source, force, folder_form)  refuse (one line) before anything is
                        read: a target that is, holds or sits inside the checkpoint being
                        read or any run folder / checkpoints folder; an existing file
                        without ``--force``; for the folder form, a file where the folder
                        goes, or a non-empty folder without ``--force``
    checkpoint_home(path) the checkpoint or checkpoints folder ``path`` is or sits in, if any
    is_export_file(name)  the names the folder form writes (config, weights, index,
                        tokenizer files): the only ones ``--force`` replaces or removes
    install(tmp, out)   move a finished export folder ``tmp`` onto ``out``: renamed whole
                        when ``out`` is new, else export's own files swapped in one by one
                        (the old ones put back if a move fails) and everything else in
                        ``out`` left as it was

A run folder is recognised by what ``zeropipe train`` leaves in it (metrics.jsonl,
checkpoints/, its lock file); a checkpoints folder by its ``latest``; a checkpoint by
its manifest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from zeropipe.apps.train.lock import LOCK_FILE
from zeropipe.core.errors import ZeropipeError

__all__ = [
    "EXPORT_FILES",
    "TOKENIZER_FILES",
    "check_target",
    "checkpoint_home",
    "install",
    "is_export_file",
]

# The tokenizer files a Hugging Face folder may hold, which export copies.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
EXPORT_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    *TOKENIZER_FILES,
)
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# What marks a folder as a run's (zeropipe train's --out); a checkpoints folder or a
# checkpoint is told by :func:`_checkpoint_marks`.  Export writes into none of them, nor
# anywhere inside the last two.
_RUN_MARKS = ("metrics.jsonl", "checkpoints", LOCK_FILE)


def is_export_file(name: str) -> bool:
    """Whether ``name`` is one the folder form of export writes."""
    return name in EXPORT_FILES or _SHARD.fullmatch(name) is not None


def _protected(source: Path) -> list[tuple[Path, str, bool]]:
    """The folders a checkpoint ``source`` lives in that export must not replace, outermost
    first, each with its role and whether a path inside it is refused too: the run folder
    that holds it (no: ``RUN/hf`` is a fine target), its checkpoints folder and the
    checkpoint itself (yes)."""
    found = [(source, "the checkpoint being read", True)]
    root = source.parent
    if (root / "latest").exists():
        found.insert(0, (root, "the checkpoints folder being read", True))
        if any((root.parent / m).exists() for m in ("metrics.jsonl", LOCK_FILE)):
            found.insert(0, (root.parent, "the run being read", False))
    return found


def _checkpoint_marks(folder: Path) -> list[str]:
    """Which of ``latest`` (naming a step folder) and a zeropipe ``manifest.json`` (its
    format and files) ``folder`` holds: both names are common, their contents are not."""
    found = []
    try:
        latest = folder / "latest"
        small = latest.is_file() and latest.stat().st_size < 64
        if small and re.fullmatch(r"step-\d{6,}", latest.read_text().strip()):
            found.append("latest")
        manifest = folder / "manifest.json"
        if manifest.is_file():
            record = json.loads(manifest.read_text())
            if isinstance(record, dict) and {"format", "files"} <= record.keys():
                found.append("manifest.json")
    except (OSError, ValueError):
        pass  # unreadable: not one we can recognise as a checkpoint's
    return found


def checkpoint_home(path: Path) -> Path | None:
    """The checkpoint or checkpoints folder ``path`` is or sits inside (resolved), or None."""
    resolved = path.absolute().resolve()
    return next((p for p in (resolved, *resolved.parents) if _checkpoint_marks(p)), None)


def _refuse_runs(out: Path, target: Path, source: Path) -> None:
    """A target that is, holds or sits in the checkpoint read, or that is a run folder, a
    checkpoints folder or a checkpoint, or sits inside one of the last two."""
    protected = _protected(source)
    outer = protected[0][0]
    example = outer / "hf" if not protected[0][2] else outer.parent / f"{outer.name}-hf"
    # The folder the target is, else the outermost it holds or sits in: the plainest words.
    for folder, role, inside in sorted(protected, key=lambda f: f[0] != target):
        how = "is" if target == folder else "holds" if target in folder.parents else None
        how = "is inside" if inside and folder in target.parents else how
        if how is not None:
            raise ZeropipeError(
                f"cannot export to {out}: it {how} {role} ({folder}); export never writes over "
                f"what it reads, even with --force; give another path, e.g. {example}"
            )
    if target.is_dir():
        marks = [m for m in _RUN_MARKS if (target / m).exists()] + _checkpoint_marks(target)
        if marks:
            hint = f", e.g. {out / 'hf'}" if "metrics.jsonl" in marks else ""
            raise ZeropipeError(
                f"cannot export to {out}: it holds a zeropipe run or checkpoint "
                f"({', '.join(marks)}); export never writes into one, even with --force; "
                f"give another path{hint}"
            )
    home = checkpoint_home(target.parent)
    if home is not None:
        raise ZeropipeError(
            f"cannot export to {out}: it is inside {home}, a checkpoint folder "
            f"({', '.join(_checkpoint_marks(home))}); give a path outside it"
        )


def check_target(out: Path, source: Path, force: bool, folder_form: bool) -> None:
    """Refuse an export target that would lose data (see the module); ``source`` is the
    checkpoint folder the export reads."""
    _refuse_runs(out, out.absolute().resolve(), source.absolute().resolve())
    if not out.exists() and not out.is_symlink():
        return
    if not folder_form:
        if out.is_dir():
            raise ZeropipeError(
                f"cannot export to {out}: it is a folder; name the file to write, "
                f"e.g. {out / 'model.safetensors'}"
            )
        if not force:
            raise ZeropipeError(f"{out} exists; pass --force to replace it, or give another name")
        return
    if not out.is_dir():
        raise ZeropipeError(
            f"cannot export to {out}: it is a file, and export writes a folder; give another "
            f"OUT_DIR (or remove the file yourself)"
        )
    if any(out.iterdir()) and not force:
        raise ZeropipeError(
            f"{out} is not an empty folder; give another OUT_DIR, or --force to replace "
            f"export's files in it (config.json, model*.safetensors, tokenizer files), "
            f"keeping the rest"
        )


def install(tmp: Path, out: Path) -> None:
    """Put the export folder ``tmp`` in place as ``out`` (see the module)."""
    if not out.exists():
        tmp.rename(out)
        return
    backup = out.parent / f".{out.name}.old-{os.getpid()}"
    backup.mkdir()
    moved_out: list[str] = []
    moved_in: list[str] = []
    try:
        for p in sorted(out.iterdir()):
            if is_export_file(p.name) and (p.is_file() or p.is_symlink()):
                p.rename(backup / p.name)
                moved_out.append(p.name)
        for p in sorted(tmp.iterdir()):
            p.rename(out / p.name)
            moved_in.append(p.name)
    except OSError:
        for name in moved_in:
            (out / name).unlink(missing_ok=True)
        for name in moved_out:
            (backup / name).rename(out / name)
        raise
    finally:
        shutil.rmtree(backup, ignore_errors=True)
