"""``zeropipe export`` never deletes or overwrites what it did not write
(zeropipe.apps.export_target): the run or checkpoint it reads, a run folder, an
existing file without ``--force``, and under ``--force`` only its own files.

One small Llama run (one process) is trained once for the module; each case copies
it, so that a case that destroyed it would not hide the next one's failure.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from zeropipe.apps.cli import main
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("export") / "run"
    cfg = TrainConfig(
        model="llama", ranks=1, steps=2, batch_size=4, microbatches=2, seq=16, width=32,
        blocks=2, schedule="1f1b", out=str(run), quiet=True,
    )  # fmt: skip
    train(cfg)
    return run


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _export(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str]:
    code = main(["export", *map(str, argv)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("target", "words"),
    [
        ("", "it is the run being read"),
        ("checkpoints", "it is the checkpoints folder being read"),
        ("checkpoints/step-000002", "it is the checkpoint being read"),
        ("checkpoints/hf", "it is inside the checkpoints folder being read"),
        ("checkpoints/latest.safetensors", "it is inside the checkpoints folder being read"),
    ],
)
@pytest.mark.parametrize("source", ["", "checkpoints"])
def test_export_into_what_it_reads_is_refused_even_with_force(
    run: Path, capsys: pytest.CaptureFixture[str], source: str, target: str, words: str
) -> None:
    before = _tree(run)
    code, err = _export(capsys, run / source, run / target, "--force")
    assert code == 2 and words in err and "even with --force" in err, err
    assert err.count("\n") == 1  # one line
    assert _tree(run) == before  # metrics, checkpoints, pictures: all still there


def test_export_into_a_folder_that_holds_the_run_or_another_run_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _export(capsys, run, tmp_path, "--force")  # holds the run being read
    assert code == 2 and "it holds the run being read" in err, err
    other = tmp_path / "other"
    shutil.copytree(run, other)
    before = _tree(other)
    for target in (other, other / "checkpoints"):
        code, err = _export(capsys, run, target, "--force")
        assert code == 2 and "holds a zeropipe run or checkpoint" in err, err
    code, err = _export(capsys, run, other / "checkpoints" / "step-000002" / "hf")
    assert code == 2 and "a checkpoint folder" in err, err
    assert _tree(other) == before


def test_an_existing_file_is_replaced_only_with_force(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    precious = tmp_path / "precious.safetensors"
    precious.write_bytes(b"a user's file")
    code, err = _export(capsys, run, precious)
    assert code == 2 and "exists; pass --force to replace it" in err, err
    assert precious.read_bytes() == b"a user's file"
    code, err = _export(capsys, run, precious, "--force")
    assert code == 0, err
    assert precious.read_bytes() != b"a user's file"
    # a file where the folder form would go is never replaced, --force or not
    plain = tmp_path / "plain"
    plain.write_text("keep me\n")
    code, err = _export(capsys, run, plain, "--force")
    assert code == 2 and "it is a file, and export writes a folder" in err, err
    assert plain.read_text() == "keep me\n"


def test_force_replaces_only_exports_own_files(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "hf"
    assert _export(capsys, run, out, "--shard-size", "20KB")[0] == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").exists()
    (out / "notes.txt").write_text("my notes\n")
    (out / "README.md").write_text("# my model\n")
    (out / "extra").mkdir()
    (out / "extra" / "data.bin").write_bytes(b"\x00\x01")
    code, err = _export(capsys, run, out)
    assert code == 2 and "--force to replace export's files in it" in err, err
    code, err = _export(capsys, run, out, "--force")  # one file now: the old shards go
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "config.json", "extra", "model.safetensors", "notes.txt",
    ]  # fmt: skip
    assert (out / "notes.txt").read_text() == "my notes\n"
    assert (out / "README.md").read_text() == "# my model\n"
    assert (out / "extra" / "data.bin").read_bytes() == b"\x00\x01"
    transformers = pytest.importorskip("transformers")
    transformers.AutoModelForCausalLM.from_pretrained(out)  # the folder still loads


def test_a_gpt_run_is_refused_before_any_tensor_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from zeropipe.runtime.checkpoint import dcp

    cfg = TrainConfig(
        ranks=1, steps=1, batch_size=4, microbatches=2, seq=16, width=32, blocks=2,
        schedule="1f1b", out=str(tmp_path / "gpt"), quiet=True,
    )  # fmt: skip
    train(cfg)

    def loaded(*args: object, **kwargs: object) -> None:
        raise AssertionError("the tensors were read before the refusal")

    monkeypatch.setattr(dcp, "consolidated_state_dict", loaded)
    code, err = _export(capsys, tmp_path / "gpt", tmp_path / "gpt-hf")
    assert code == 2 and "ending in .safetensors" in err, err
