"""zeropipe train: loss falls, resume is exact, a killed rank fails cleanly, bad flags are one line."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from zeropipe.apps.cli import main
from zeropipe.apps.models.gpt import GPTConfig, gpt, lm_loss
from zeropipe.apps.train import resume as train_resume
from zeropipe.apps.train import state as train_state
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import layout, train
from zeropipe.apps.train.rank import train_rank
from zeropipe.apps.train.workload import batch, build_model, load_corpus, loss_fn, model_layers
from zeropipe.core.errors import PipelineError, ZeropipeError
from zeropipe.core.ir import Kind
from zeropipe.runtime.checkpoint.dcp import consolidated_state_dict
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline

SMALL = {"width": 32, "blocks": 2, "seq": 16, "batch_size": 8, "microbatches": 4, "quiet": True}


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]  # not the eval-only rows (the start's eval)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert all({"step", "loss", "tokens_per_s"} <= r.keys() for r in rows)
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-rank run of 6 steps checkpointed every 2 (step-000004 and step-000006 stay): the
    losses a resumed run must give, and checkpoints the tests damage only in copies."""
    out = tmp_path_factory.mktemp("uninterrupted")
    train(TrainConfig(**SMALL, steps=6, out=str(out), checkpoint_every=2))
    return out


@dataclass(frozen=True)
class Killed:
    """The run ``_rank_1_dies_saving_step_6`` ended: its folder, the error, how long it took."""

    out: Path
    error: str
    seconds: float


def _rank_1_dies_saving_step_6(rank: int, world: int, cfg: TrainConfig) -> object:
    """train_rank, but rank 1 exits abruptly (as SIGKILL would) as it starts saving step 6."""
    if rank == 1:
        save = train_state.save_checkpoint

        def die_at_step_6(pipe: object, opt: object, path: Path, **kw: object) -> Path:
            if Path(path).name == "step-000006":
                os._exit(17)
            return save(pipe, opt, path, **kw)  # type: ignore[arg-type]

        train_state.save_checkpoint = die_at_step_6  # type: ignore[assignment]  # this process only
    return train_rank(rank, world, cfg)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Killed:
    """The uninterrupted run's settings for 8 steps, rank 1 killed saving step 6: its
    checkpoint of step 4 is what the resume tests start from (each in a copy)."""
    out = tmp_path_factory.mktemp("killed")
    cfg = TrainConfig(**SMALL, steps=8, out=str(out), checkpoint_every=2, timeout=20.0)
    cfg.check()
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        launch(_rank_1_dies_saving_step_6, 2, cfg, timeout=80, threads=1)
    return Killed(out, str(err.value), time.monotonic() - start)


def _copy(run: Path, to: Path) -> Path:
    """A copy of a run's folder to resume or damage; the shared one stays as it was."""
    shutil.copytree(run, to, symlinks=True)
    return to


def test_killed_rank_ends_the_run_with_a_clear_message_and_the_checkpoint_loads(
    killed: Killed,
) -> None:
    assert killed.seconds < 90
    assert "rank 1" in killed.error
    root = killed.out / "checkpoints"
    assert train_state.latest_step(root) == 4 and not (root / "step-000006").exists()
    manifest = train_state.verify(root)
    assert manifest is not None and manifest.step == 4
    tensors, _ = consolidated_state_dict(root / "step-000004")
    assert "0.token.weight" in tensors


def test_resume_gives_the_losses_of_an_uninterrupted_run(
    uninterrupted: Path, killed: Killed, tmp_path: Path
) -> None:
    """Resumed on the same 2 ranks from the checkpoint the killed run left (step 4)."""
    half = _copy(killed.out, tmp_path / "half")
    assert train_state.latest_step(half / "checkpoints") == 4
    summary = train(TrainConfig(**SMALL, steps=6, out=str(half), resume=True, checkpoint_every=100))
    assert summary["steps_run"] == 2
    assert _losses(half) == _losses(uninterrupted)  # exactly, step by step
    for name in ("metrics.jsonl", "timeline.png", "trace.json", "loss.png"):
        assert (uninterrupted / name).stat().st_size > 0, name
    trace = json.loads((uninterrupted / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])


def test_loss_falls_on_the_default_model(tmp_path: Path) -> None:
    summary = train(TrainConfig(steps=60, out=str(tmp_path), quiet=True))
    # From ~3.45 (uniform over the alphabet) the eval loss drops below 2.85 within 60 steps.
    assert summary["initial_eval_loss"] > 3.3
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--schedule", "nope"], "unknown schedule 'nope'"),
        (["--schedule", "dualpipev", "--microbatches", "2"], "use microbatches >= 3"),
        (["--ranks", "9"], "use fewer ranks or more --blocks"),
        (["--batch-size", "4"], "raise the batch size"),
        (["--memory-limit", "0.1"], "raise it to at least 0.5"),
        (["--recompute", "7"], "stage(s) [7] do not exist"),
        (["--group-w", "0"], "--group-w must be >= 1"),
        (["--group-w", "2", "--schedule", "auto"], "the search groups W itself"),
    ],
)
def test_bad_flags_are_one_line_errors(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zeropipe: error:") and needle in err[0], err


def test_resume_without_a_checkpoint_says_so(tmp_path: Path) -> None:
    with pytest.raises(ZeropipeError, match="no checkpoint to resume from"):
        train(TrainConfig(**SMALL, ranks=1, steps=2, out=str(tmp_path), resume=True))


def test_group_w_gathers_w_and_trains_to_the_same_losses(tmp_path: Path) -> None:
    cfg = TrainConfig(
        **SMALL, ranks=2, schedule="1f1b", steps=3, group_w=2, out=str(tmp_path / "b")
    )
    schedule = cfg.build_schedule()
    assert schedule.name == "1f1b+w2"
    assert not any(a.kind is Kind.B for actions in schedule.actions for a in actions)
    train(TrainConfig(**SMALL, ranks=1, schedule="1f1b", steps=3, out=str(tmp_path / "a")))
    grouped = train(
        TrainConfig(**SMALL, ranks=1, schedule="1f1b", steps=3, group_w=2, out=str(tmp_path / "b"))
    )
    assert grouped["group_w"] == 2
    # Fused W sums the same products in another order: float32 rounding only.
    assert _losses(tmp_path / "b") == pytest.approx(_losses(tmp_path / "a"), rel=1e-5)


def test_memory_flags_change_the_peak_not_the_losses(tmp_path: Path) -> None:
    plain = train(TrainConfig(**SMALL, ranks=1, schedule="gpipe", steps=2, out=str(tmp_path / "a")))
    lean = train(
        TrainConfig(
            **SMALL,
            ranks=1,
            schedule="gpipe",
            steps=2,
            out=str(tmp_path / "b"),
            recompute="all",
            offload="all",
        )
    )
    assert plain["final_train_loss"] == lean["final_train_loss"]
    peaks = [
        json.loads(line).get("peak_saved_bytes", 0)  # 0: the start's eval row
        for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    ]
    full = [
        json.loads(line).get("peak_saved_bytes", 0)
        for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    ]
    assert max(peaks) < max(full)


def test_checkpointed_blocks_train_to_the_same_losses_holding_less(tmp_path: Path) -> None:
    # Every attention and MLP layer keeps its input only and runs again in its backward,
    # replaying its dropout masks: the same losses, fewer saved bytes.
    runs = {}
    for name, extra in (("plain", {}), ("blocks", {"checkpoint_blocks": True})):
        out = tmp_path / name
        cfg = TrainConfig(
            **SMALL, ranks=1, schedule="gpipe", steps=2, dropout=0.1, out=str(out), **extra
        )
        runs[name] = (train(cfg), _peak_saved(out))
    assert runs["plain"][0]["final_train_loss"] == runs["blocks"][0]["final_train_loss"]
    assert runs["blocks"][1] < runs["plain"][1]


def _peak_saved(out: Path) -> int:
    rows = (out / "metrics.jsonl").read_text().splitlines()
    return max(json.loads(line).get("peak_saved_bytes", 0) for line in rows)


# -- training state is safe: corrupt files, non-finite losses, changed flags, bad devices ----
def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """Run ``zeropipe`` in this process: its exit code and its stderr lines."""
    capsys.readouterr()  # what came before is not this command's
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def _small_argv(out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--width", "32", "--blocks", "2", "--batch-size", "8", "--microbatches", "4",
        "--out", str(out), "--quiet", *extra,
    ]  # fmt: skip


def test_a_corrupt_checkpoint_is_refused_in_one_line_and_latest_stays(
    uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(uninterrupted, tmp_path / "run")
    root = run / "checkpoints"
    victim = root / "step-000006" / "__1_0.distcp"  # rank 1's tensors
    data = bytearray(victim.read_bytes())
    middle = len(data) // 2 // 4 * 4  # inside a tensor: only the checksum can tell
    data[middle : middle + 16] = b"\xff" * 16  # NaN bit patterns
    victim.write_bytes(bytes(data))
    metrics = (run / "metrics.jsonl").read_text()
    code, err = _cli(_small_argv(run, "--seq", "16", "--steps", "8", "--resume"), capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("zeropipe: error:"), err
    assert str(victim) in err[0] and "step-000004" in err[0] and "--out" in err[0], err
    assert train_state.latest_step(root) == 6
    assert (run / "metrics.jsonl").read_text() == metrics


def test_a_non_finite_loss_stops_training_before_it_is_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # lr 1000 (warm-up: 50, then 100, ...) blows up on 2 ranks: step 2's loss (~8e4) is still
    # finite but its update leaves non-finite weights (step 3's loss would be NaN).  The old
    # code saved step 2 and moved `latest` to it.
    argv = _small_argv(tmp_path, "--steps", "6", "--checkpoint-every", "1", "--lr", "1000")
    code, err = _cli(argv, capsys)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("zeropipe: error:"), err
    assert "weights became non-finite" in err[0] and "step 2" in err[0], err
    assert "step-000001" in err[0] and "lower --lr" in err[0], err
    root = tmp_path / "checkpoints"
    assert train_state.latest_step(root) == 1
    assert not (root / "step-000002").exists()
    assert len(_losses(tmp_path)) == 2  # step 2's finite loss is recorded, nothing after it


def test_a_loss_that_turns_nan_in_process_names_its_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from zeropipe.apps.train import workload

    calls = 0
    real = workload.lm_loss

    def nan_from_step_3(logits: object, target: object) -> object:
        nonlocal calls
        loss = real(logits, target)  # type: ignore[arg-type]
        if not torch.is_grad_enabled():  # evaluation: not a training step
            return loss
        calls += 1
        return loss * float("nan") if calls > 2 * 4 else loss  # 4 microbatches a step

    monkeypatch.setattr(workload, "lm_loss", nan_from_step_3)
    argv = _small_argv(tmp_path, "--ranks", "1", "--steps", "5", "--checkpoint-every", "1")
    code, err = _cli(argv, capsys)
    assert code == 2
    assert len(err) == 1 and "loss became non-finite (nan) at step 3" in err[0], err
    assert "step-000002" in err[0], err
    assert train_state.latest_step(tmp_path / "checkpoints") == 2
    assert not (tmp_path / "checkpoints" / "step-000003").exists()
    assert len(_losses(tmp_path)) == 2


def test_blocks_and_layers_are_counted_as_the_model_has_them() -> None:
    # --blocks 2: the GPT's nn.Sequential is embedding, attention and MLP of each block, head.
    cfg = TrainConfig(**SMALL)
    vocab = load_corpus(cfg).vocab
    _, cut, model = build_model(cfg, vocab, 2)
    assert model_layers(cfg, vocab) == len(model) == sum(cut or []) == 6
    # Up to one stage per layer: 3 zbv ranks hold 6 stages (refused before as "4 layers").
    cfg = TrainConfig(**{**SMALL, "ranks": 3, "schedule": "zbv"})
    cfg.check()
    assert build_model(cfg, vocab, 6)[1] == [1, 1, 1, 1, 1, 1]
    with pytest.raises(ZeropipeError) as err:
        TrainConfig(**{**SMALL, "ranks": 4, "schedule": "zbv"}).check()
    assert str(err.value) == (
        "--ranks 4 with zbv needs 8 stages but the model has 6 layers (2 blocks; embedding, "
        "attention and MLP of each block, head), and a stage needs a layer; use fewer ranks "
        "or more --blocks"
    )


def test_resume_reads_the_blocks_of_settings_saved_as_layers(tmp_path: Path) -> None:
    """Checkpoints saved while --blocks was called --layers record it as "layers"."""
    one = {**SMALL, "ranks": 1, "schedule": "1f1b", "out": str(tmp_path)}
    train(TrainConfig(**one, steps=1))
    manifest = tmp_path / "checkpoints" / "step-000001" / train_state.MANIFEST
    record = json.loads(manifest.read_text())
    settings = record["meta"]["config"]
    settings["layers"] = settings.pop("blocks")
    manifest.write_text(json.dumps(record))
    with pytest.raises(ZeropipeError, match="--blocks 3 differs from the checkpoint's 2"):
        train_resume.check_resume(TrainConfig(**{**one, "blocks": 3}, steps=2, resume=True))
    summary = train(TrainConfig(**one, steps=2, resume=True))
    assert summary["steps_run"] == 1


def test_resume_with_other_flags_names_each_one_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--ranks", "1", "--schedule", "1f1b"]
    code, err = _cli(_small_argv(tmp_path, *base, "--steps", "2"), capsys)
    assert code == 0, err
    latest = (tmp_path / "checkpoints" / "latest").read_text()
    cases = [
        (["--width", "48"], ["--width 48 differs from the checkpoint's 32"]),
        (["--batch-size", "16"], ["--batch-size 16 differs from the checkpoint's 8"]),
        (["--microbatches", "2"], ["--microbatches 2 differs from the checkpoint's 4"]),
        (["--seed", "1"], ["--seed 1 differs from the checkpoint's 0"]),
        (
            ["--lr", "0.01", "--blocks", "3"],
            ["--lr 0.01 differs from the checkpoint's 0.003", "--blocks 3 differs"],
        ),
    ]
    for flags, needles in cases:
        argv = _small_argv(tmp_path, *base, "--steps", "4", "--resume")
        # argparse keeps the last value of a repeated flag: these override the base ones
        code, err = _cli([*argv, *flags], capsys)
        assert code == 2, flags
        assert len(err) == 1 and err[0].startswith("zeropipe: error:"), err
        assert all(n in err[0] for n in needles) and "start a new --out" in err[0], err
        assert (tmp_path / "checkpoints" / "latest").read_text() == latest
    # What may change: the length of the run, the checkpoint interval, the timeout, the output.
    extend = _small_argv(tmp_path, *base, "--steps", "3", "--resume", "--checkpoint-every", "5")
    code, err = _cli([*extend, "--timeout", "60"], capsys)
    assert code == 0, err
    assert train_state.latest_step(tmp_path / "checkpoints") == 3


@pytest.mark.parametrize("device", ["banana", "cuda:x", ""])
def test_a_device_torch_cannot_parse_is_a_one_line_error(
    device: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _cli(["train", "--device", device], capsys)
    assert code == 2
    assert len(err) == 1 and f"--device {device!r}" in err[0] and "cpu" in err[0], err


def test_a_device_this_machine_lacks_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has the device")
    code, err = _cli(["train", "--device", "cuda"], capsys)
    assert code == 2
    assert len(err) == 1 and "--device 'cuda'" in err[0] and "not available" in err[0], err


def _as_an_older_zeropipe_left_it(out: Path, cfg: TrainConfig) -> None:
    """Rewrite the latest checkpoint of a 1-rank run in the older format: rank0.pt, no manifest."""
    root = out / "checkpoints"
    corpus = load_corpus(cfg)
    schedule = cfg.build_schedule()
    stages, cut, model = build_model(cfg, corpus.vocab, schedule.num_stages)
    pipe = Pipeline(stages, schedule, loss_fn=loss_fn(cfg), balance=cut, mesh="local")
    opt = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr, weight_decay=0.0)
    step = train_resume.resume(root, 0, pipe, opt, cfg, model)
    state = {
        "step": step,
        "stages": {s: st.module.state_dict() for s, st in pipe.stages.items()},
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
    }
    for folder in root.glob("step-*"):
        shutil.rmtree(folder)
    train_state.save_rank(root, step, 0, state)


def test_resume_from_a_checkpoint_without_a_manifest_warns_and_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = _small_argv(tmp_path, "--ranks", "1", "--schedule", "1f1b")
    code, err = _cli([*base, "--steps", "2"], capsys)
    assert code == 0, err
    cfg = TrainConfig(width=32, blocks=2, batch_size=8, microbatches=4, ranks=1, schedule="1f1b")
    _as_an_older_zeropipe_left_it(tmp_path, cfg)
    root = tmp_path / "checkpoints"
    assert train_state.read_manifest(root) is None
    code, err = _cli([*base, "--steps", "4", "--width", "48", "--resume"], capsys)
    assert code == 2  # the settings could not be compared; loading the weights tells
    assert len(err) == 2 and "unverified" in err[0], err
    assert "does not fit this model (size mismatch for" in err[1], err
    assert "start a new --out" in err[1], err
    code, err = _cli([*base, "--steps", "3", "--resume"], capsys)
    assert code == 0
    assert len(err) == 1 and err[0].startswith("zeropipe: warning:") and "unverified" in err[0]
    assert train_state.latest_step(root) == 3
    manifest = train_state.verify(root)  # what it saves next is a DCP checkpoint, verified
    assert manifest is not None and manifest.format == 2


def test_resume_on_other_ranks_and_schedule_continues_with_the_same_losses(
    killed: Killed, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The killed run's checkpoint (2 ranks, zbv, step 4) resumed on 1 rank with gpipe."""
    full, moved = tmp_path / "full", _copy(killed.out, tmp_path / "moved")
    small = ("--seq", "16", "--steps", "6")
    code, err = _cli(_small_argv(full, "--ranks", "1", "--schedule", "1f1b", *small), capsys)
    assert code == 0, err
    argv = _small_argv(moved, "--ranks", "1", "--schedule", "gpipe", *small, "--resume")
    code, err = _cli(argv, capsys)
    assert code == 0, err
    # float32: another cut and schedule sum the same products in another order
    assert _losses(moved) == pytest.approx(_losses(full), rel=1e-5)
    assert len(_losses(moved)) == 6


def test_dp_and_clip_resume_on_another_dp_and_ranks_with_the_same_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dp 2 (each replica on half of every batch) and --clip give one pipeline's losses;
    saved on 2 ranks x 2 replicas (4 processes), resumed on 1 rank x 2 replicas."""
    full, moved = tmp_path / "full", tmp_path / "moved"
    clip = ("--clip", "0.5")
    code, err = _cli(_small_argv(full, "--ranks", "1", "--steps", "4", *clip), capsys)
    assert code == 0, err
    code, err = _cli(_small_argv(moved, "--ranks", "2", "--dp", "2", "--steps", "2", *clip), capsys)
    assert code == 0, err
    argv = _small_argv(moved, "--ranks", "1", "--dp", "2", "--steps", "4", "--resume", *clip)
    code, err = _cli(argv, capsys)
    assert code == 0, err
    assert _losses(moved) == pytest.approx(_losses(full), rel=1e-5)
    rows = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    # The norm before clipping: it did clip (the start's eval row has none).
    assert all(r["grad_norm"] > 0.5 for r in rows if "loss" in r)


def test_dp_flags_that_cannot_work_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, message in (
        (["--dp", "0"], "--dp must be >= 1"),
        (["--dp", "3"], "cannot be split evenly among --dp 3"),
        (["--dp", "4", "--microbatches", "4"], "gives 2 sequences per replica"),
        (["--clip", "0"], "--clip must be > 0"),
    ):
        code, err = _cli(_small_argv(tmp_path, *argv), capsys)
        assert code != 0 and len(err) == 1 and message in err[0], (argv, err)


def test_export_writes_the_model_that_gives_the_pipelines_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    cfg = TrainConfig(width=32, blocks=2, seq=16, batch_size=8, microbatches=4, quiet=True)
    cfg.ranks, cfg.schedule, cfg.steps, cfg.out = 1, "1f1b", 2, str(tmp_path)
    summary = train(cfg)
    out = tmp_path / "model.safetensors"
    code, err = _cli(["export", str(tmp_path), str(out)], capsys)
    assert code == 0, err
    corpus = load_corpus(cfg)
    shape = GPTConfig(
        vocab=corpus.vocab, seq=16, width=32, heads=cfg.heads, layers=2, dropout=cfg.dropout
    )
    fresh = gpt(shape, seed=99)  # other weights until loaded
    tensors = load_file(str(out))
    assert set(tensors) == set(fresh.state_dict())  # tied head included: strict loading works
    fresh.load_state_dict(tensors)
    assert fresh[-1].out.weight is fresh[0].token.weight  # type: ignore[union-attr]  # still tied
    with torch.no_grad():
        losses = [
            lm_loss(fresh(x), y).item()
            for x, y in (batch(corpus, cfg, k, "val") for k in range(cfg.eval_batches))
        ]
    assert sum(losses) / len(losses) == pytest.approx(summary["final_eval_loss"], rel=1e-6)
    code, err = _cli(["export", str(tmp_path / "nowhere"), str(out)], capsys)
    assert code == 2 and len(err) == 1 and "is not a checkpoint" in err[0], err


# -- flags that only the ranks used to trip over: one line before any process starts ----
@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--timeout", "-5"], "--timeout must be a number of seconds > 0 (how long a rank"),
        (["--timeout", "nan"], "--timeout must be a number of seconds > 0"),
        (["--lr", "-1"], "--lr must be a finite number >= 0, got -1"),
        (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
        (["--width", "30"], "--width 30 must be a multiple of the 4 heads; use e.g. --width 32"),
        (["--width", "-4"], "--width must be >= 1, got -4"),
        (["--blocks", "-1"], "--blocks must be >= 1, got -1"),
        (["--memory-limit", "nan"], "--memory-limit must be a number > 0"),
        (["--tp", "0"], "--tp must be >= 1 (1: no tensor parallelism), got 0"),
        (
            ["--tp", "3"],
            "--tp 3 must divide the GPT's 4 attention heads (each process holds "
            "whole heads); use --tp 1, 2 or 4",
        ),
        (["--model", "gpt2", "--tp", "2"], "tensor-parallel plan"),
        (["--model", "llama", "--tp", "4"], "--tp 4 must divide the llama model's 2 key/value"),
    ],
)
def test_flags_the_ranks_would_trip_over_are_one_line_before_launching(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    code, err = _cli(["train", "--ranks", "2", "--out", str(tmp_path), *argv], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("zeropipe: error: "), err
    assert needle in err[0], err
    assert time.monotonic() - start < 10  # refused here, not after starting the ranks


def test_the_python_api_checks_what_only_the_command_line_checked() -> None:
    # Every step divides by it: the ranks would fail with a ZeroDivisionError.
    with pytest.raises(ZeropipeError, match=r"^--checkpoint-every must be >= 1 \(steps"):
        TrainConfig(**SMALL, checkpoint_every=0).check()


def test_an_out_folder_that_cannot_be_made_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "out"
    code, err = _cli(["train", "--ranks", "2", "--out", str(out)], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"zeropipe: error: --out {out} cannot be made ("), err


def test_launch_times_that_cannot_work_name_themselves() -> None:
    with pytest.raises(
        PipelineError, match=r"^launch: timeout must be positive \(seconds, > 0\), got -5$"
    ):
        launch(_every_rank_refuses, 2, timeout=-5)
    with pytest.raises(PipelineError, match=r"^launch: grace must be a number of seconds >= 0"):
        launch(_every_rank_refuses, 2, grace=-1)


def _every_rank_refuses(rank: int, world: int) -> None:
    raise ZeropipeError("--knob 3 cannot work here; use --knob 2")


def test_an_error_every_rank_raises_on_purpose_is_reported_once_as_one_line() -> None:
    with pytest.raises(PipelineError) as err:
        launch(_every_rank_refuses, 2, timeout=120)
    assert str(err.value) == "--knob 3 cannot work here; use --knob 2"


def test_resume_with_steps_not_above_the_checkpoint_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _cli(_small_argv(tmp_path, "--ranks", "1", "--steps", "2"), capsys)
    assert code == 0, err
    for steps in ("2", "1"):
        code, err = _cli(_small_argv(tmp_path, "--resume", "--steps", steps), capsys)
        assert code == 2 and len(err) == 1, err
        assert err[0] == (
            f"zeropipe: error: --resume: the checkpoint is at step 2; --steps {steps} must be "
            f"above it to train more (checkpoint {tmp_path / 'checkpoints' / 'step-000002'})"
        )


def test_tp_trains_the_one_process_losses_and_resumes_on_tp_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ranks 2 --tp 2 (4 processes), every layer checkpointed, trains as one process does;
    its checkpoint, whose tensor-parallel weights and AdamW moments are stored as shards,
    resumes at --tp 1 without the checkpointing (a memory flag may change on resume)."""
    full, moved = tmp_path / "full", tmp_path / "moved"
    code, err = _cli(_small_argv(full, "--ranks", "1", "--steps", "4"), capsys)
    assert code == 0, err
    tp2 = ("--ranks", "2", "--tp", "2", "--steps", "2", "--checkpoint-blocks")
    code, err = _cli(_small_argv(moved, *tp2), capsys)
    assert code == 0, err
    manifest = train_state.verify(moved / "checkpoints")
    assert manifest is not None and manifest.meta["config"]["tp"] == 2
    argv = _small_argv(moved, "--ranks", "2", "--tp", "1", "--steps", "4", "--resume")
    argv.remove("--quiet")  # the start-up line names the layout
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("zeropipe train: gpt on pp 2 x dp 1 x tp 1 = 2 processes, "), out
    # steps 1..4, each once (_losses checks): the resumed run went on from step 3.
    # float32: tensor parallelism sums each row-parallel product in two halves.
    assert _losses(moved) == pytest.approx(_losses(full), rel=1e-5)
    assert len(_losses(moved)) == 4


def test_layout_names_every_dimension() -> None:
    assert layout(TrainConfig(ranks=2, tp=2)) == "pp 2 x dp 1 x tp 2 = 4 processes"
    assert layout(TrainConfig(ranks=1)) == "pp 1 x dp 1 x tp 1 = 1 process"
