"""Checkpoints: the manifest's checksums catch changed files, old checkpoints still load,
non-finite states are refused, and every refusal names the file and what to do."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from zeropipe import build_schedule
from zeropipe.apps.train import state as train_state
from zeropipe.apps.train.state import CheckpointError
from zeropipe.core.errors import ZeropipeError


def _state(step: int, scale: float = 1.0) -> dict[str, Any]:
    return {
        "step": step,
        "stages": {0: {"weight": torch.full((64, 8), scale), "bias": torch.zeros(8)}},
        "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": []},
        "rng": torch.get_rng_state(),
    }


def _checkpoint(root: Path, step: int, ranks: int = 2, meta: dict[str, Any] | None = None) -> None:
    digests = [train_state.save_rank(root, step, r, _state(step, r + 1.0)) for r in range(ranks)]
    train_state.publish(root, step, digests, meta or {"config": {"width": 32}})


def _flip_inside_a_tensor(path: Path) -> None:
    """Overwrite bytes in the middle of the largest tensor; the zip stays readable."""
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    middle = info.header_offset + 30 + name_len + extra_len + info.file_size // 2 // 4 * 4
    raw[middle : middle + 8] = b"\xff" * 8
    path.write_bytes(bytes(raw))
    torch.load(path, weights_only=True)  # still loads: only a checksum can tell


def test_a_saved_checkpoint_verifies_and_loads(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 4)
    manifest = train_state.verify(tmp_path)
    assert manifest is not None and manifest.step == 4 and manifest.ranks == 2
    assert manifest.meta == {"config": {"width": 32}}
    folder = train_state.step_dir(tmp_path, 4)
    assert manifest.files["rank1.pt"] == train_state.sha256_of(folder / "rank1.pt")
    state = train_state.load_rank(tmp_path, 1)
    assert state["step"] == 4 and torch.equal(
        state["stages"][0]["weight"], torch.full((64, 8), 2.0)
    )
    assert not list(folder.glob(".*tmp*"))  # no temporary file left behind


def test_a_changed_byte_is_refused_naming_the_file_and_the_checkpoints_that_verify(
    tmp_path: Path,
) -> None:
    _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    victim = train_state.step_dir(tmp_path, 4) / "rank1.pt"
    _flip_inside_a_tensor(victim)
    for check in (lambda: train_state.verify(tmp_path), lambda: train_state.load_rank(tmp_path, 1)):
        with pytest.raises(CheckpointError) as err:
            check()
        text = str(err.value)
        assert isinstance(err.value, ZeropipeError) and "\n" not in text
        assert f"{victim} is corrupt" in text and "sha256" in text
        assert "step-000002" in text and "step-000004:" not in text
        assert "start afresh with a new --out" in text
    assert train_state.load_rank(tmp_path, 0)["step"] == 4  # the intact rank file still loads
    assert train_state.latest_step(tmp_path) == 4  # reading never moves latest
    assert train_state.load_rank(tmp_path, 1, step=2)["step"] == 2


def test_with_no_intact_checkpoint_left_the_error_says_to_start_afresh(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2, ranks=1)
    path = train_state.step_dir(tmp_path, 2) / "rank0.pt"
    path.write_bytes(path.read_bytes()[:-100])  # truncated, as by a bad copy
    with pytest.raises(CheckpointError, match=r"no other checkpoint .* verifies: start afresh"):
        train_state.verify(tmp_path)


def test_a_missing_rank_file_or_unreadable_manifest_is_a_checkpoint_error(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    folder = train_state.step_dir(tmp_path, 2)
    (folder / "rank1.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank1\.pt is missing"):
        train_state.verify(tmp_path)
    with pytest.raises(CheckpointError, match=r"saved with --ranks 2"):
        train_state.load_rank(tmp_path, 1)
    (folder / train_state.MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"cannot read .*manifest\.json"):
        train_state.verify(tmp_path)
    (folder / train_state.MANIFEST).write_text(json.dumps({"format": 99}))
    with pytest.raises(CheckpointError, match="format 99"):
        train_state.verify(tmp_path)


def test_publish_refuses_a_checkpoint_with_a_rank_file_missing(tmp_path: Path) -> None:
    digest = train_state.save_rank(tmp_path, 2, 0, _state(2))
    with pytest.raises(CheckpointError, match=r"lacks rank file\(s\) \[1\]"):
        train_state.publish(tmp_path, 2, [digest, digest])
    assert train_state.latest_step(tmp_path) is None
    assert not (train_state.step_dir(tmp_path, 2) / train_state.MANIFEST).exists()


def test_publish_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        _checkpoint(tmp_path, step, ranks=1)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000003"]
    assert train_state.latest_step(tmp_path) == 3


def test_a_checkpoint_from_before_manifests_loads_unverified(tmp_path: Path) -> None:
    # Written as zeropipe wrote them before checksums: rank files and `latest`, no manifest.
    train_state.save_rank(tmp_path, 6, 0, _state(6))
    (tmp_path / "latest").write_text("step-000006\n")
    assert train_state.read_manifest(tmp_path) is None
    assert train_state.verify(tmp_path) is None
    assert train_state.load_rank(tmp_path, 0)["step"] == 6


def test_a_state_with_non_finite_values_is_refused_even_without_a_manifest(
    tmp_path: Path,
) -> None:
    # What the old training loop could leave behind: `latest` on a checkpoint of NaN weights.
    state = _state(6)
    state["stages"][0]["weight"][3, 1] = float("nan")
    train_state.save_rank(tmp_path, 6, 0, state)
    (tmp_path / "latest").write_text("step-000006\n")
    with pytest.raises(CheckpointError, match=r"non-finite values \(in stages/0/weight\)"):
        train_state.load_rank(tmp_path, 0)


def test_latest_naming_a_folder_that_is_gone_is_a_checkpoint_error(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "latest").write_text("step-000009\n")
    with pytest.raises(CheckpointError, match="names step-000009, which does not exist"):
        train_state.verify(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint to resume from"):
        train_state.verify(tmp_path / "elsewhere")


# -- DCP checkpoints (zeropipe.runtime.checkpoint.dcp) as zeropipe train keeps them ----------------
def _dcp_checkpoint(root: Path, step: int) -> None:
    from tests.gradcheck import token_loss, token_model
    from zeropipe.runtime.pipeline import Pipeline

    pipe = Pipeline(
        token_model(layers=4), build_schedule("1f1b", ranks=2, microbatches=2), loss_fn=token_loss
    )
    opt = torch.optim.AdamW(pipe.parameters())
    train_state.save_step(root, step, pipe, opt, extra={"step": step}, meta={"config": {}})


def test_a_dcp_checkpoint_is_found_verified_and_named_by_latest(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 1, ranks=1)  # an older per-rank checkpoint beside it
    _dcp_checkpoint(tmp_path, 2)
    manifest = train_state.verify(tmp_path)
    assert manifest is not None and manifest.format == 2 and manifest.step == 2
    assert ".metadata" in manifest.files and manifest.meta == {"config": {}, "step": 2}
    folder = train_state.step_dir(tmp_path, 2)
    for source in (folder, tmp_path):
        assert train_state.checkpoint_folder(source) == folder
    with pytest.raises(CheckpointError, match=r"is not a checkpoint: it has no manifest\.json"):
        train_state.checkpoint_folder(tmp_path / "nothing")
    (folder / ".metadata").write_bytes(b"changed")
    with pytest.raises(CheckpointError, match=r"\.metadata is corrupt.*step-000001"):
        train_state.verify(tmp_path)


def test_export_without_safetensors_names_the_extra_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    _dcp_checkpoint(tmp_path / "ckpt", 2)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # import fails
    with pytest.raises(ZeropipeError, match=r"pip install 'zeropipe\[hf\]'"):
        train_state.export_safetensors(tmp_path / "ckpt", tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_export_refuses_an_older_per_rank_checkpoint(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt", 2, ranks=1)
    with pytest.raises(CheckpointError, match="has format 1, not 2"):
        train_state.export_safetensors(tmp_path / "ckpt", tmp_path / "m.safetensors")


def test_export_to_a_folder_or_under_a_file_is_one_line_naming_the_path(tmp_path: Path) -> None:
    _dcp_checkpoint(tmp_path / "ckpt", 2)
    (tmp_path / "folder").mkdir()
    with pytest.raises(ZeropipeError, match=r"cannot export to .*: it is a folder; name the file"):
        train_state.export_safetensors(tmp_path / "ckpt", tmp_path / "folder")
    # root can write into any folder whatever its mode; nothing can be made under a file
    (tmp_path / "file").write_text("not a folder\n")
    with pytest.raises(ZeropipeError, match=r"/file is a file, not a folder") as caught:
        train_state.export_safetensors(tmp_path / "ckpt", tmp_path / "file" / "m.safetensors")
    assert "\n" not in str(caught.value)


def test_export_over_a_0600_file_gets_the_permissions_of_a_new_file(tmp_path: Path) -> None:
    import os

    import safetensors.torch

    _dcp_checkpoint(tmp_path / "ckpt", 2)
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"an earlier export")
    out.chmod(0o600)
    umask = os.umask(0o027)
    try:
        train_state.export_safetensors(tmp_path / "ckpt", out, force=True)
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o640  # 0666 less the umask, not safetensors' 0600
    assert set(safetensors.torch.load_file(out)) >= {"0.weight"}


def test_a_failed_export_leaves_the_earlier_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import safetensors.torch
    from safetensors import SafetensorError

    _dcp_checkpoint(tmp_path / "ckpt", 2)
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"an earlier export")

    def disk_full(tensors: Any, filename: str, metadata: Any = None) -> None:
        Path(filename).write_bytes(b"half a file")
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(ZeropipeError, match=r"cannot export to .*m\.safetensors: .*No space left"):
        train_state.export_safetensors(tmp_path / "ckpt", out, force=True)
    assert out.read_bytes() == b"an earlier export"
    assert sorted(p.name for p in tmp_path.iterdir() if "safetensors" in p.name) == [out.name]


def test_pruning_removes_only_the_runs_own_step_folders(tmp_path: Path) -> None:
    for name in (
        "step-000001",
        "step-000002",
        "step-000003",
        "step-000002-keep",
        "step-000050.bak",
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "data").write_text(name)
    train_state.point_latest(tmp_path, 3, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step-000002", "step-000002-keep", "step-000003", "step-000050.bak",
    ]  # fmt: skip
    # by number, not by name: step-1000000 is newer than step-999999
    for step in (999999, 1000000):
        train_state.step_dir(tmp_path, step).mkdir()
    train_state.point_latest(tmp_path, 1000000, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-000002-keep", "step-000050.bak", "step-1000000",
    ]  # fmt: skip
