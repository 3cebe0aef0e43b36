"""Saves that fail -- a full disk, a path that cannot be written, a kill between the two
renames of a re-save -- end every rank with one line naming the path and the cause, leave
no ``.partial`` folder, and lose no checkpoint that was complete."""

from __future__ import annotations

import errno
import io
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import filesystem

from tests.gradcheck import batch_for, token_loss, token_model
from zeropipe import build_schedule
from zeropipe.runtime.checkpoint.dcp import (
    consolidated_state_dict,
    load_checkpoint,
    save_checkpoint,
)
from zeropipe.runtime.checkpoint.folder import CheckpointError, verify_checkpoint
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions


def _pipe(ranks: int = 2) -> Pipeline:
    built = build_schedule("1f1b", ranks=ranks, microbatches=2)
    return Pipeline(token_model(layers=4), built, token_loss, options=RuntimeOptions(timeout=30))


class _Quota(io.FileIO):
    """A file on a disk with 4 KiB free: a write past them fails as a full disk does."""

    def write(self, data: Any) -> int:
        if self.tell() + memoryview(data).nbytes > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


@contextmanager
def _full_disk_stream(self: Any, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
    # A small buffer makes the write fail inside torch.save, as on a real full disk: torch
    # then raises "unexpected pos 704 vs 598" while handling the OSError.
    with io.BufferedWriter(_Quota(path, "w"), buffer_size=64) as stream:
        yield stream


def _one_line(message: str, *words: str) -> None:
    assert "\n" not in message, message
    for word in words:
        assert word in message, (word, message)


def test_a_full_disk_is_one_line_naming_the_path_and_leaves_the_saved_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = _pipe()
    path = tmp_path / "c"
    save_checkpoint(pipe, None, path, extra="first")
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", _full_disk_stream)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(pipe, None, path, extra="second")
    _one_line(str(caught.value), str(path), "no space left on device", "free space")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no .partial, no .old
    monkeypatch.undo()
    assert load_checkpoint(_pipe(), None, path) == "first"


def _failing_saves(rank: int, world: int, root: str) -> list[str]:
    pipe = _pipe(world)
    told = []
    try:  # root/file is a regular file: nothing can be made under it, even by root,
        # which chmod would not stop
        save_checkpoint(pipe, None, Path(root) / "file" / "ckpt")
    except CheckpointError as exc:
        told.append(str(exc))
    if rank == 1:  # only rank 1's disk is full: rank 0 must learn why
        filesystem.FileSystem.create_stream = _full_disk_stream  # type: ignore[method-assign]
    try:
        save_checkpoint(pipe, None, Path(root) / "full")
    except CheckpointError as exc:
        told.append(str(exc))
    return told


def _refused_alike(rank: int, world: int, path: str) -> str:
    try:
        save_checkpoint(_pipe(world), None, path)
    except CheckpointError as exc:
        return str(exc)
    return "saved"


def _two_rank_cases(rank: int, world: int, failing_root: str, refused: str) -> dict[str, Any]:
    """The saves that fail on 2 ranks, in one launch: first a save to an existing folder that
    is not a checkpoint (refused before any rank writes), then ``_failing_saves`` (which
    leaves rank 1's disk full)."""
    return {
        "refused": _refused_alike(rank, world, refused),
        "failing": _failing_saves(rank, world, failing_root),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``_two_rank_cases`` on 2 processes: each rank's lines, and the folders they saved to."""
    failing_root = tmp_path_factory.mktemp("failing")
    (failing_root / "file").write_text("not a folder\n")
    refused = tmp_path_factory.mktemp("refused") / "results"
    (refused / "run1").mkdir(parents=True)
    (refused / "run1" / "data.csv").write_text("a,b\n1,2\n")
    told = launch(_two_rank_cases, 2, str(failing_root), str(refused), timeout=120, threads=1)
    return {"told": told, "failing_root": failing_root, "refused": refused}


def test_every_rank_ends_with_the_same_line_when_a_path_cannot_be_written_or_a_disk_is_full(
    two_ranks: dict[str, Any],
) -> None:
    root = two_ranks["failing_root"]
    told = [out["failing"] for out in two_ranks["told"]]
    assert told[0] == told[1]
    unwritable, full = told[0]
    _one_line(unwritable, str(root / "file" / "ckpt"), "not a directory", "save elsewhere")
    _one_line(full, str(root / "full"), "no space left on device on rank 1", "free space")
    assert sorted(p.name for p in root.iterdir()) == ["file"]  # no .partial left


class _Killed(BaseException):
    """Stands for a SIGKILL: nothing the save does on failure runs."""


def test_a_resave_killed_between_its_renames_loads_the_newest_complete_folder_it_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe, path = _pipe(), tmp_path / "c"
    save_checkpoint(pipe, None, path, extra="first")
    with torch.no_grad():
        for p in pipe.parameters():
            p.add_(1.0)
    replace = os.replace

    def killed_before_the_second_rename(src: Any, dst: Any) -> None:
        if Path(src).name == ".c.partial":
            raise _Killed
        replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_before_the_second_rename)
    with pytest.raises(_Killed):
        save_checkpoint(pipe, None, path, extra="second")
    monkeypatch.undo()
    partial, old = tmp_path / ".c.partial", tmp_path / ".c.old"
    assert not path.exists() and verify_checkpoint(partial) and verify_checkpoint(old)
    with pytest.raises(CheckpointError) as caught:
        verify_checkpoint(path)
    _one_line(str(caught.value), str(partial), str(old), "rename")
    fresh = _pipe()
    with pytest.warns(UserWarning, match=r"loading .*\.c\.partial.*rename it to"):
        assert load_checkpoint(fresh, None, path) == "second"
    for a, b in zip(fresh.parameters(), pipe.parameters(), strict=True):
        assert torch.equal(a, b)
    with pytest.warns(UserWarning, match=r"\.c\.partial"):
        tensors, _ = consolidated_state_dict(path)
    assert torch.equal(tensors["0.weight"], token_model(layers=4).state_dict()["0.weight"] + 1)
    # the newest does not verify: the replaced one still loads
    metadata = (partial / ".metadata").read_bytes()
    (partial / ".metadata").write_bytes(b"changed")
    with pytest.warns(UserWarning, match=r"loading .*\.c\.old"):
        assert load_checkpoint(_pipe(), None, path) == "first"
    (partial / ".metadata").write_bytes(metadata)
    # the next save first renames the complete .partial into place: failing, it loses nothing
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", _full_disk_stream)
    with pytest.raises(CheckpointError, match="no space left on device"):
        save_checkpoint(pipe, None, path, extra="third")
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_checkpoint(_pipe(), None, path) == "second"
    save_checkpoint(pipe, None, path, extra="third")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert load_checkpoint(_pipe(), None, path) == "third"


def test_a_path_that_exists_and_is_not_a_checkpoint_is_refused_and_left_as_it_was(
    tmp_path: Path, two_ranks: dict[str, Any]
) -> None:
    results = tmp_path / "results"
    (results / "run1").mkdir(parents=True)
    (results / "run1" / "data.csv").write_text("a,b\n1,2\n")
    note = tmp_path / "notes.txt"
    note.write_text("mine\n")
    pipe = _pipe()
    for _ in range(2):  # the second save used to delete what the first had moved aside
        for path in (results, note):
            with pytest.raises(CheckpointError) as caught:
                save_checkpoint(pipe, None, path)
            _one_line(str(caught.value), str(path), "exists and is", "no manifest.json")
            _one_line(str(caught.value), "save to a new path or remove it")
    assert "a file" in str(caught.value)
    assert (results / "run1" / "data.csv").read_text() == "a,b\n1,2\n"
    assert note.read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "results"]
    # every rank fails with rank 0's line, before any rank writes (the same folder, saved to
    # on 2 ranks)
    told = [out["refused"] for out in two_ranks["told"]]
    assert told[0] == told[1] and "is not a checkpoint" in told[0]
    refused = two_ranks["refused"]
    assert sorted(p.name for p in refused.parent.iterdir()) == ["results"]
    assert (refused / "run1" / "data.csv").read_text() == "a,b\n1,2\n"
    # an empty folder is taken, and a checkpoint is re-saved over
    (tmp_path / "empty").mkdir()
    save_checkpoint(pipe, None, tmp_path / "empty", extra="first")
    save_checkpoint(pipe, None, tmp_path / "empty", extra="second")
    assert load_checkpoint(_pipe(), None, tmp_path / "empty") == "second"


@pytest.mark.parametrize("path", ["", "."])
def test_a_path_with_no_folder_name_is_one_line_asking_for_one(path: str) -> None:
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(_pipe(), None, path)
    _one_line(str(caught.value), "names no folder", "give a folder name")


def test_an_unpicklable_extra_is_told_to_be_picklable_not_to_free_space(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(_pipe(), None, tmp_path / "c", extra={"f": lambda: 1})
    _one_line(str(caught.value), str(tmp_path / "c"), "extra= ", "must be picklable")
    assert "free space" not in str(caught.value) and "writable" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # no .partial left


def _stepped(optimizer: type[torch.optim.Optimizer], **kw: Any) -> tuple[Pipeline, Any]:
    pipe = _pipe()
    opt = optimizer(pipe.parameters(), lr=0.01, **kw)
    pipe.step(*batch_for(token_model(layers=4), batch=4))
    opt.step()
    return pipe, opt


def test_optimizer_state_of_another_kind_is_one_line_naming_the_keys(tmp_path: Path) -> None:
    pipe, sgd = _stepped(torch.optim.SGD, momentum=0.9)
    save_checkpoint(pipe, sgd, tmp_path / "c")
    fresh = _pipe()
    for other, adamw in (
        (fresh, torch.optim.AdamW(fresh.parameters())),
        _stepped(torch.optim.AdamW),
    ):
        kept = [sorted(v) for v in adamw.state.values()]  # a new AdamW's, one that has stepped
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(other, adamw, tmp_path / "c")
        _one_line(str(caught.value), "saved with SGD", "'momentum_buffer'", "'step'")
        _one_line(str(caught.value), "same kind of optimizer", "optimizer=None")
        assert [sorted(v) for v in adamw.state.values()] == kept  # left as it was
    load_checkpoint(_pipe(), None, tmp_path / "c")  # the model alone still loads


def test_a_checkpoint_saved_without_an_optimizer_refuses_one_on_load(tmp_path: Path) -> None:
    save_checkpoint(_pipe(), None, tmp_path / "model-only", extra="x")
    pipe = _pipe()
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(pipe, torch.optim.AdamW(pipe.parameters()), tmp_path / "model-only")
    _one_line(str(caught.value), "holds no optimizer state", "pass optimizer=None")
    assert load_checkpoint(pipe, None, tmp_path / "model-only") == "x"
    # an optimizer with no state yet (or one that keeps none, plain SGD) is not refused
    for opt in (torch.optim.AdamW(pipe.parameters()), torch.optim.SGD(pipe.parameters(), lr=1)):
        save_checkpoint(pipe, opt, tmp_path / "fresh", extra="y")
        assert load_checkpoint(pipe, type(opt)(pipe.parameters(), lr=1), tmp_path / "fresh") == "y"
