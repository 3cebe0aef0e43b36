"""Rough edges of the command line a new user hits: a torn metrics.jsonl on --resume, a
deleted checkpoints/latest, a --data file with a comma in its name, a tokenizer --out inside
its --data folder, and --shard-size where it cannot apply.  Each refusal is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from zeropipe.apps.cli import main
from zeropipe.apps.data.tokens import data_paths
from zeropipe.apps.train import state
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import train
from zeropipe.apps.train.state import CheckpointError
from zeropipe.apps.train.workload import load_corpus
from zeropipe.core.errors import ZeropipeError

TINY = {
    "ranks": 1, "batch_size": 8, "microbatches": 4, "seq": 16, "width": 32, "blocks": 2,
    "schedule": "1f1b", "quiet": True,
}  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-step run with checkpoints at steps 2 and 4; copy it before changing it."""
    out = tmp_path_factory.mktemp("edges") / "run"
    train(TrainConfig(**TINY, steps=4, checkpoint_every=2, out=str(out)))  # type: ignore[arg-type]
    assert state.latest_step(out / "checkpoints") == 4
    return out


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _resume(out: Path, steps: int = 5) -> dict[str, object]:
    cfg = TrainConfig(**TINY, steps=steps, checkpoint_every=2, out=str(out), resume=True)  # type: ignore[arg-type]
    return train(cfg)


def _steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "loss" in r]


# -- 1. metrics.jsonl torn by a kill or a full disk ----------------------------------------
def test_a_torn_last_metrics_line_is_dropped_with_a_note(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics = run / "metrics.jsonl"
    good = metrics.read_text()
    metrics.write_text(good + '{"step": 5, "loss": 3.4')  # what a kill mid-write leaves
    summary = _resume(run)
    err = capsys.readouterr().err
    assert summary["steps_run"] == 1
    lines = [ln for ln in err.splitlines() if "metrics.jsonl" in ln]
    assert len(lines) == 1 and "torn" in lines[0] and "dropped" in lines[0], err
    assert metrics.read_text().startswith(good)  # every good row kept
    assert _steps(run) == [1, 2, 3, 4, 5]


def test_a_bad_metrics_line_in_the_middle_is_refused_naming_the_line(run: Path) -> None:
    metrics = run / "metrics.jsonl"
    rows = metrics.read_text().splitlines()
    rows.insert(2, "not a row")
    before = "\n".join(rows) + "\n"
    metrics.write_text(before)
    with pytest.raises(ZeropipeError) as err:
        _resume(run)
    text = str(err.value)
    assert "\n" not in text and f"{metrics}, line 3" in text
    assert "remove that line" in text and "--overwrite" in text
    assert metrics.read_text() == before  # nothing lost, nothing rewritten


def test_trim_metrics_drops_only_a_torn_last_line(tmp_path: Path) -> None:
    from zeropipe.apps.train.resume import trim_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "eval_loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.9}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    path.write_text(text + "\n" + '{"step": 3, "lo')
    assert trim_metrics(path, 2) is False
    assert path.read_text() == text
    path.write_text(text + '{"step": 1}\n[1, 2]\n' + json.dumps(rows[0]) + "\n")
    with pytest.raises(ZeropipeError, match=r"metrics\.jsonl, line 5 is not a metrics row"):
        trim_metrics(path, 2)


# -- 2. checkpoints/latest deleted or naming a folder that is gone -------------------------
def test_resume_without_latest_takes_the_newest_checkpoint_that_verifies(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = run / "checkpoints"
    (root / "latest").unlink()
    # the newest is corrupt: the one before it is the newest *complete* checkpoint
    (state.step_dir(root, 4) / ".metadata").write_bytes(b"changed")
    (root / "step-2").mkdir()  # not a name zeropipe writes: never a candidate
    assert state.latest_step(root) == 2
    summary = _resume(run, steps=3)
    err = capsys.readouterr().err
    assert summary["steps_run"] == 1
    note = (
        f"{root / 'latest'} is missing; resuming from step-000002, the newest complete checkpoint"
    )
    assert note in err and err.count(note) == 1
    assert state.latest_step(root) == 3 and (root / "latest").read_text().strip() == ("step-000003")


def test_latest_naming_a_folder_that_is_gone_falls_back_too(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = run / "checkpoints"
    (root / "latest").write_text("step-000009\n")
    assert state.latest_step(root) == 4
    assert _resume(run)["steps_run"] == 1
    assert "names step-000009, which does not exist; resuming from step-000004" in (
        capsys.readouterr().err
    )


def test_with_no_checkpoint_that_verifies_the_refusal_is_one_line(run: Path) -> None:
    root = run / "checkpoints"
    (root / "latest").unlink()
    for step in (2, 4):
        (state.step_dir(root, step) / ".metadata").write_bytes(b"changed")
    with pytest.raises(CheckpointError) as err:
        _resume(run)
    assert "\n" not in str(err.value) and f"no checkpoint to resume from in {root}" in str(
        err.value
    )


def test_export_finds_the_newest_complete_checkpoint_without_latest(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (run / "checkpoints" / "latest").unlink()
    out = tmp_path / "m.safetensors"
    assert main(["export", str(run), str(out)]) == 0
    std = capsys.readouterr()
    assert out.exists() and "step-000004" in std.out
    assert "is missing; exporting step-000004, the newest complete checkpoint" in std.err
    assert state.checkpoint_folder(run) == state.step_dir(run / "checkpoints", 4)


# -- 3. --data: a comma list, or one path holding a comma ----------------------------------
def test_a_data_file_with_a_comma_in_its_name_is_read_as_one_path(tmp_path: Path) -> None:
    named = tmp_path / "a,b.txt"
    named.write_text("some text to train on. " * 200)
    assert data_paths(str(named)) == [str(named)]
    cfg = TrainConfig(**TINY, data=str(named), out=str(tmp_path / "o"))  # type: ignore[arg-type]
    corpus = load_corpus(cfg)
    assert corpus.vocab == 256


def test_a_missing_piece_of_the_data_list_says_it_is_a_comma_list(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("text")
    spec = f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt'}"
    assert data_paths(f"{tmp_path / 'a.txt'},{tmp_path / 'a.txt'}") == [str(tmp_path / "a.txt")] * 2
    with pytest.raises(ZeropipeError) as err:
        data_paths(spec)
    text = str(err.value)
    assert "\n" not in text and f"--data {tmp_path / 'b.txt'} does not exist" in text
    assert "comma-separated list" in text
    cfg = TrainConfig(**TINY, data=spec, out=str(tmp_path / "o"))  # type: ignore[arg-type]
    with pytest.raises(ZeropipeError, match="comma-separated list"):
        load_corpus(cfg)


# -- 4. zeropipe tokenizer --out inside its --data folder -----------------------------------
@pytest.mark.parametrize("inside", ["", "tok", "sub/tok"])
def test_a_tokenizer_out_in_its_data_folder_is_refused(
    tmp_path: Path, inside: str, capsys: pytest.CaptureFixture[str]
) -> None:
    corp = tmp_path / "corp"
    corp.mkdir()
    (corp / "a.txt").write_text("hello world, " * 100)
    out = corp / inside if inside else corp
    code = main(["tokenizer", "--data", str(corp), "--vocab", "300", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "would be read as documents" in err and "another --out" in err
    assert sorted(p.name for p in corp.rglob("*")) == ["a.txt"]  # nothing written
    # beside the data, not in it: trained
    code = main(["tokenizer", "--data", str(corp), "--vocab", "300", "--out", str(tmp_path / "t")])
    assert code == 0 and (tmp_path / "t" / "tokenizer.json").is_file()


# -- 5. --shard-size: checked always, refused for a .safetensors file ----------------------
@pytest.mark.parametrize("size", ["0", "2XB", "0.0000001"])
@pytest.mark.parametrize("target", ["m.safetensors", "hf"])
def test_a_bad_shard_size_is_refused_for_either_target(
    run: Path, tmp_path: Path, size: str, target: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / target
    assert main(["export", str(run), str(out), "--shard-size", size]) == 2
    err = capsys.readouterr().err
    assert f"--shard-size {size!r}: give bytes" in err and err.count("\n") == 1
    assert not out.exists()


def test_a_shard_size_given_with_a_safetensors_file_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "m.safetensors"
    assert main(["export", str(run), str(out), "--shard-size", "2GB"]) == 2
    err = capsys.readouterr().err
    assert (
        "--shard-size splits a folder OUT_DIR's safetensors; a .safetensors OUT is one file" in err
    )
    assert not out.exists()
    assert main(["export", str(run), str(out)]) == 0 and out.exists()


def test_what_an_early_stop_kept_is_told_without_latest(run: Path) -> None:
    from zeropipe.apps.train.resume import kept_checkpoint

    cfg = TrainConfig(**TINY, out=str(run))  # type: ignore[arg-type]
    root = run / "checkpoints"
    assert kept_checkpoint(cfg).startswith(f"{root / 'latest'} names step-000004; run the same")
    (root / "latest").unlink()
    assert kept_checkpoint(cfg).startswith(f"{root / 'latest'} is missing: step-000004 is kept")
