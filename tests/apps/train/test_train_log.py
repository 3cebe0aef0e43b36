"""zeropipe train's run folder, ETA, logging sinks and --config files, without training."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from zeropipe.apps.cli import build_parser, main
from zeropipe.apps.train import log as train_log
from zeropipe.apps.train import report, state
from zeropipe.apps.train.config import TrainConfig
from zeropipe.core.errors import ZeropipeError


def test_eta_is_the_remaining_steps_at_the_median_step_time() -> None:
    assert train_log.eta([1.0, 1.0, 30.0], 65) == "ETA 1m05s"  # a slow checkpoint step ignored
    assert train_log.eta([0.5], 7) == "ETA 4s"
    assert train_log.eta([2.0, 4.0], 3600) == "ETA 3h00m"
    assert train_log.eta([], 10) == "" and train_log.eta([1.0], 0) == ""


def _record(step: int) -> dict[str, Any]:
    return {"step": step, "loss": 2.0, "tokens_per_s": 1000.0, "bubble_rate": 0.1,
            "peak_saved_bytes": 0}  # fmt: skip


def test_the_progress_line_gets_the_eta_and_keeps_its_terminal_behaviour(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    report.progress(_record(25), 100, " | ETA 1m05s")
    out = capsys.readouterr().out
    assert "step 25/100" in out and out.endswith(" | ETA 1m05s\n")
    report.progress(_record(3), 100, " | ETA 9s")
    assert capsys.readouterr().out == ""  # not a terminal: every 25th step only
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    report.progress(_record(3), 100, " | ETA 9s")
    assert capsys.readouterr().out.endswith(
        "step 3/100 | loss 2.000 | 1,000 tok/s | bubble 10% | ETA 9s\r"
    )


def test_model_line_names_parameters_bytes_sequence_and_vocabulary() -> None:
    line = train_log.model_line(1_234_567, 4_938_268, 48, 31)
    assert line == "model: 1.23M parameters (4.7 MiB), sequence length 48, vocabulary 31"


def test_a_run_folder_is_refused_or_cleared_of_zeropipe_files_only(tmp_path: Path) -> None:
    train_log.check_run_dir(tmp_path, resume=False, overwrite=False)  # empty: a new run
    (tmp_path / "checkpoints" / "step-000001").mkdir(parents=True)
    for name in ("trace.json", "loss.png", "data.txt"):
        (tmp_path / name).write_text("x")
    with pytest.raises(ZeropipeError, match=r"holds a run \(checkpoints/\); pass --resume"):
        train_log.check_run_dir(tmp_path, resume=False, overwrite=False)
    train_log.check_run_dir(tmp_path, resume=True, overwrite=False)
    with pytest.raises(ZeropipeError, match="pass one of them"):
        train_log.check_run_dir(tmp_path, resume=True, overwrite=True)
    train_log.check_run_dir(tmp_path, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.txt"]


def test_a_sink_whose_package_is_missing_is_refused_naming_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert train_log.check_loggers("jsonl") == ["jsonl"]
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ZeropipeError) as err:
        train_log.check_loggers("jsonl,wandb")
    assert str(err.value) == (
        "--log wandb needs the wandb package, which is not installed: pip install wandb "
        "(or pip install 'zeropipe[wandb]')"
    )
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ZeropipeError, match=r"pip install tensorboard \(or pip install 'zeropipe"):
        train_log.check_loggers("tensorboard")
    with pytest.raises(ZeropipeError, match="unknown sink 'csv'; choose from jsonl, tensorboard"):
        train_log.check_loggers("jsonl,csv")


def _settings(argv: list[str]) -> dict[str, Any]:
    args = build_parser(["train"]).parse_args(["train", *argv])
    return train_log.settings_from(args, TrainConfig)


def test_config_file_keys_are_flags_and_the_command_line_overrides_them(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('batch-size = 32\nbatch_size = 32\nlr = 1\nsteps = 7\nlog = "jsonl"\n')
    got = _settings(["--config", str(path), "--steps", "300"])  # 300: also the default
    assert got == {"batch_size": 32, "lr": 1.0, "steps": 300, "log": "jsonl"}
    assert isinstance(got["lr"], float)
    assert _settings(["--ranks", "1"]) == {"ranks": 1}  # no file: the flags given only
    cfg = TrainConfig(**_settings(["--config", str(path)]))
    assert (cfg.batch_size, cfg.steps, cfg.width) == (32, 7, TrainConfig().width)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("step = 3\n", "unknown key 'step'; did you mean steps (--steps)?"),
        ("batchsize = 3\n", "unknown key 'batchsize'; did you mean batch_size (--batch-size)?"),
        ("warmup = 3\n", "unknown key 'warmup'"),  # not a flag
        ('steps = "3"\n', "steps = '3' is not an integer (as --steps takes)"),
        ("quiet = 1\n", "quiet = 1 is not true or false"),
        ("steps = \n", "is not valid TOML"),
    ],
)
def test_bad_config_files_are_one_line_errors(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ZeropipeError) as err:
        _settings(["--config", str(path)])
    assert needle in str(err.value) and "\n" not in str(err.value), err.value
    assert str(err.value).startswith(f"--config {path}")


# -- through the command line: one run, refused, resumed with its config, overwritten ------
def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # not the start's eval row
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["loss"] for r in rows]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_run_in_out_is_refused_then_resumed_with_its_config_or_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--config FILE.toml (flags override it) trains, resumes exactly, and --out is guarded."""
    config = tmp_path / "run.toml"
    config.write_text(
        'width = 32\nblocks = 2\nbatch-size = 8\nmicrobatches = 4\nranks = 1\nschedule = "1f1b"\n'
        "steps = 99\ncheckpoint_every = 1\n"
    )
    full, run = tmp_path / "full", tmp_path / "run"
    code, err = _cli(["train", "--config", str(config), "--steps", "4", "--out", str(full)], capsys)
    assert code == 0, err
    argv = ["train", "--config", str(config), "--out", str(run), "--log", "jsonl,tensorboard"]
    assert main([*argv, "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "zeropipe train: gpt on pp 1 x dp 1 x tp 1 = 1 process, schedule 1f1b"
    assert out[1].startswith("zeropipe train: model: ") and " parameters (" in out[1], out
    assert out[1].endswith("sequence length 48, vocabulary 31"), out
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    # The run is there: a new one into it is refused before anything starts, naming both ways.
    metrics = (run / "metrics.jsonl").read_text()
    code, err = _cli([*argv, "--steps", "4"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        f"zeropipe: error: --out {run} already holds a run (metrics.jsonl and checkpoints/); "
        f"pass --resume to continue it or --overwrite to replace it, or give another --out"
    )
    assert (run / "metrics.jsonl").read_text() == metrics
    assert main([*argv, "--steps", "4", "--resume"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == f"zeropipe train: resumed from step 2 ({run / 'checkpoints' / 'step-000002'})"
    assert _losses(run) == _losses(full)  # steps 1..4 once each, exactly those of one run
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(_losses(full))
    assert {"eval/loss", "train/tokens_per_s", "train/bubble_rate"} <= set(acc.Tags()["scalars"])
    # --overwrite: zeropipe's files go (tensorboard/ too), anything else stays.
    (run / "notes.txt").write_text("mine")
    code, err = _cli(["train", "--config", str(config), "--out", str(run), "--quiet", "--steps",
                      "2", "--overwrite"], capsys)  # fmt: skip
    assert code == 0, err
    assert len(_losses(run)) == 2 and not (run / "tensorboard").exists()
    assert (run / "notes.txt").read_text() == "mine"
    assert state.latest_step(run / "checkpoints") == 2
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-000001",
        "step-000002",
    ]


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_overwrite_removes_only_what_zeropipe_wrote(tmp_path: Path) -> None:
    run = tmp_path
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step-000002\n")
    (run / "checkpoints" / "step-000002-keep").mkdir()  # the user's copy
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.vm.2.0").write_text("x")
    (run / "tensorboard" / "my-notes.md").write_text("mine")
    (run / "wandb" / "offline-run-20261128_010203-abc").mkdir(parents=True)
    (run / "wandb" / "latest-run").symlink_to("offline-run-20261128_010203-abc")
    (run / "loss.png").write_text("x")
    (run / "notes.txt").write_text("mine")
    train_log.check_run_dir(run, resume=False, overwrite=True)
    assert _files(run) == [
        "checkpoints", "checkpoints/step-000002-keep", "notes.txt", "tensorboard",
        "tensorboard/my-notes.md",
    ]  # fmt: skip


def test_a_checkpoints_folder_of_another_program_is_never_touched(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "my_model.pt").write_text("weights")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1").write_text("x")
    before = _files(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(
            ZeropipeError, match=r"has a checkpoints/ folder that is not zeropipe's"
        ):
            train_log.check_run_dir(tmp_path, resume=False, overwrite=overwrite)
    assert _files(tmp_path) == before


def test_an_out_in_a_checkpoint_folder_is_refused(tmp_path: Path) -> None:
    ckpts = tmp_path / "run" / "checkpoints"
    (ckpts / "step-000002").mkdir(parents=True)
    (ckpts / "latest").write_text("step-000002\n")
    (ckpts / "step-000002" / "manifest.json").write_text('{"format": 2, "files": {}}\n')
    for out, words in (
        (ckpts, "is /"),
        (ckpts / "step-000002", "is /"),
        (ckpts / "step-000002" / "nested", "is inside /"),
        (ckpts / "mine", "is inside /"),
    ):
        for flags in ((False, False), (False, True), (True, False)):
            with pytest.raises(ZeropipeError, match=r"a zeropipe checkpoint folder") as caught:
                train_log.check_run_dir(out, *flags)
            assert words in str(caught.value)
    # files that merely share the names are not checkpoints
    other = tmp_path / "web"
    other.mkdir()
    (other / "latest").write_text("v2\n")
    (other / "manifest.json").write_text('{"name": "app"}\n')
    train_log.check_run_dir(other / "run", resume=False, overwrite=False)
