"""Rough edges of ``zeropipe train`` a new user runs into, each answered in one honest line.

A stopped run's summary has no end eval (never ``nan``); metrics.jsonl holds the start and
end evals the summary prints, and loss.png draws them; empty data is refused as empty;
``--model-path`` runs are told in ``--model-path``'s words; ``--resume`` refuses data that
changed at the same path; a batch that cannot fit in memory is refused before launch.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from zeropipe.apps.data.tokenizer import TextTokenizer, train_tokenizer
from zeropipe.apps.train import report, state, workload
from zeropipe.apps.train import resume as train_resume
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import train
from zeropipe.core.errors import ZeropipeError
from zeropipe.runtime.checkpoint.folder import FORMAT as DCP_FORMAT

GiB = 2**30
TINY: dict[str, Any] = {
    "ranks": 1,
    "schedule": "1f1b",
    "width": 16,
    "blocks": 1,
    "seq": 8,
    "batch_size": 4,
    "microbatches": 2,
    "eval_batches": 1,
    "quiet": True,
}


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


# -- 1. the summary of a stopped run ---------------------------------------------------------
def _summary(**over: Any) -> dict[str, Any]:
    base = {
        "model": "gpt", "schedule": "zbv", "group_w": 1, "ranks": 2, "dp": 1, "tp": 1,
        "steps_run": 7, "last_step": 7, "initial_eval_loss": 3.42, "final_eval_loss": 1.5,
        "final_train_loss": 1.6, "wall_s": 1.0,
    }  # fmt: skip
    return {**base, **over}


@pytest.mark.parametrize("end", [None, math.nan])
def test_a_stopped_run_s_summary_says_it_had_no_end_eval(
    end: float | None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report.print_summary(_summary(final_eval_loss=end), tmp_path)
    out = capsys.readouterr().out
    assert "nan" not in out, out
    assert "eval loss" in out and "3.420 at start; no end eval (stopped at step 7)" in out


def test_a_finished_run_s_summary_gives_both_evals(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report.print_summary(_summary(), tmp_path)
    assert "eval loss (start -> end)  3.420 -> 1.500" in capsys.readouterr().out


# -- 2. the evals in metrics.jsonl and on loss.png ---------------------------------------------
def test_loss_png_is_drawn_with_the_eval_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    rows = [
        {"step": 0, "eval_loss": 3.5},
        {"step": 1, "loss": 3.4},
        {"step": 2, "loss": 3.0, "eval_loss": 2.9},
        {"step": 3, "loss": 2.5, "eval_loss": 2.4},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn: list[tuple[list[int], list[float]]] = []
    plot = Axes.plot

    def recording(self: Axes, *args: Any, **kw: Any) -> Any:
        drawn.append((list(args[0]), list(args[1])))
        return plot(self, *args, **kw)

    monkeypatch.setattr(Axes, "plot", recording)
    report.write_pictures(tmp_path, None, None)  # type: ignore[arg-type]  # no trace
    assert drawn == [([1, 2, 3], [3.4, 3.0, 2.5]), ([0, 2, 3], [3.5, 2.9, 2.4])]
    assert (tmp_path / "loss.png").stat().st_size > 0


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("the cat sat on the mat. " * 40)
    return path


def test_metrics_hold_the_start_and_end_evals_and_grown_data_is_refused_on_resume(
    text_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    cfg = TrainConfig(
        **TINY, steps=2, data=str(text_file), data_cache=str(tmp_path / "cache"), out=str(out)
    )
    summary = train(replace(cfg))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, "eval_loss": summary["initial_eval_loss"]}
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval_loss" not in rows[1]
    assert rows[2]["eval_loss"] == summary["final_eval_loss"]
    # 5. The file grows at the same path: the held-out windows would move.
    with open(text_file, "a") as fh:
        fh.write("a dog ran in the park. " * 80)
    with pytest.raises(ZeropipeError) as exc:
        train(replace(cfg, steps=3, resume=True))
    message = _one_line(exc)
    assert message.startswith("--resume: --data changed since checkpoint"), message
    assert f"{text_file.resolve()} changed (" in message and " -> " in message
    assert "restore the data, or start a new run with another --out (or --overwrite)" in message


def test_a_touched_but_unchanged_data_file_resumes(text_file: Path, tmp_path: Path) -> None:
    """A new modification time alone is not a change: the tokens are compared, not stamps."""
    out = tmp_path / "run"
    cfg = TrainConfig(
        **TINY, steps=1, data=str(text_file), data_cache=str(tmp_path / "cache"), out=str(out)
    )
    train(replace(cfg))
    text_file.write_text(text_file.read_text())  # same bytes, new mtime
    summary = train(replace(cfg, steps=2, resume=True))
    assert summary["last_step"] == 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # The end eval of step 1 is the resumed run's start eval: one row of it, not two.
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval_loss" in rows[1] and "eval_loss" in rows[2]


# -- 3. empty data ---------------------------------------------------------------------------
@pytest.mark.parametrize("content", ["", "  \n\t\n"])
def test_an_empty_or_blank_text_file_is_refused_by_train_and_tokenizer(
    tmp_path: Path, content: str
) -> None:
    path = tmp_path / "empty.txt"
    path.write_text(content)
    cfg = TrainConfig(data=str(path), data_cache=str(tmp_path / "cache"), steps=1, quiet=True)
    with pytest.raises(ZeropipeError) as exc:
        cfg.check()
    want = f"--data {path} holds no text (empty or only whitespace); give a file with text"
    assert _one_line(exc) == want
    pytest.importorskip("tokenizers")
    with pytest.raises(ZeropipeError) as exc:
        train_tokenizer([path], 300, tmp_path / "tok", progress=None)
    assert _one_line(exc) == want
    assert not (tmp_path / "tok" / "tokenizer.json").exists()


def test_jsonl_without_text_keeps_its_own_hint(tmp_path: Path) -> None:
    cache = str(tmp_path / "cache")
    cases = {
        "": "holds no text: no rows (empty, or only blank lines)",
        '{"text": ""}\n{"text": "  "}\n': "every row's 'text' field is empty or whitespace; "
        "give --text-field",
        '{"body": "hello"}\n': "line 1 has no string field 'text' (keys: body); name the field",
    }
    for k, (content, hint) in enumerate(cases.items()):
        path = tmp_path / f"rows{k}.jsonl"
        path.write_text(content)
        with pytest.raises(ZeropipeError) as exc:
            TrainConfig(data=str(path), data_cache=cache, steps=1, quiet=True).check()
        message = _one_line(exc)
        assert str(path) in message and hint in message, message


# -- 4. --model-path's runs told in its words ------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("hf") / "base"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return root


def test_a_model_path_s_seq_and_vocabulary_are_told_in_its_flags(
    folder: Path, text_file: Path, tmp_path: Path
) -> None:
    with pytest.raises(ZeropipeError) as exc:
        TrainConfig(model_path=str(folder), seq=64, steps=1, quiet=True).check()
    assert _one_line(exc) == (
        f"--seq 64 is beyond the model's position table (32, max_position_embeddings in "
        f"{folder.absolute() / 'config.json'}); give --seq 32 or less"
    )
    data = {"data": str(text_file), "data_cache": str(tmp_path / "cache")}
    with pytest.raises(ZeropipeError) as exc:
        TrainConfig(model_path=str(folder), seq=16, steps=1, quiet=True, **data).check()
    message = _one_line(exc)
    assert "without a tokenizer is read as bytes (256 token ids)" in message
    assert f"the model at {folder.absolute()} has a vocabulary of 100" in message
    pytest.importorskip("tokenizers")
    train_tokenizer([text_file], 300, tmp_path / "tok", progress=None)
    cfg = TrainConfig(
        model_path=str(folder), tokenizer=str(tmp_path / "tok"), seq=16, steps=1, quiet=True,
        **data,
    )  # fmt: skip
    with pytest.raises(ZeropipeError) as exc:
        cfg.check()
    tokens = TextTokenizer.load(tmp_path / "tok").vocab
    assert _one_line(exc) == (
        f"the tokenizer {(tmp_path / 'tok').absolute()} has {tokens} tokens but the model at "
        f"{folder.absolute()} has a vocabulary of 100; use the tokenizer the model was "
        f"trained with"
    )


def test_a_resume_from_another_model_path_names_the_folder(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other"
    other.symlink_to(folder, target_is_directory=True)
    out = str(tmp_path / "run")
    then = TrainConfig(model_path=str(folder), seq=16, steps=4, quiet=True, out=out)
    then.check()
    saved = state.Manifest(
        step=2, files={}, meta={"config": train_resume.run_settings(then)}, format=DCP_FORMAT
    )
    monkeypatch.setattr(state, "verify", lambda root: saved)
    now = TrainConfig(model_path=str(other), seq=16, steps=4, quiet=True, out=out, resume=True)
    now.check()
    with pytest.raises(ZeropipeError) as exc:
        train_resume.check_resume(now)
    message = _one_line(exc)
    assert message.startswith(
        f"--resume: this run was trained from --model-path {folder.absolute()}; "
        f"pass --model-path {folder.absolute()} or start a new --out"
    ), message
    assert "--model-config" not in message and "--model " not in message
    gpt = TrainConfig(seq=16, steps=4, quiet=True, out=out, resume=True)
    with pytest.raises(ZeropipeError) as exc:
        train_resume.check_resume(gpt)
    assert f"pass --model-path {folder.absolute()} " in _one_line(exc)


# -- 6. the batch's memory -------------------------------------------------------------------
def test_an_absurd_batch_is_refused_before_launch_naming_the_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(workload, "available_memory", lambda: 16 * GiB)
    with pytest.raises(ZeropipeError) as exc:
        workload.check_model(TrainConfig(batch_size=2_000_000, steps=1))
    message = _one_line(exc)
    assert message.startswith("--batch-size 2000000 of --seq 48 tokens needs at least "), message
    assert "GiB of memory for its token ids and activations" in message
    assert "this machine has 16.0 GiB available; use --batch-size " in message
    largest = int(message.split("use --batch-size ")[1].split()[0])
    workload.check_model(TrainConfig(batch_size=largest, steps=1))  # what it offers fits


def test_the_defaults_and_the_readme_s_runs_fit_a_small_machine(
    monkeypatch: pytest.MonkeyPatch, folder: Path
) -> None:
    monkeypatch.setattr(workload, "available_memory", lambda: 1 * GiB)
    workload.check_model(TrainConfig())
    # The walkthrough's base run (a 400-token tokenizer) and its --model-path fine-tune.
    base = TrainConfig(model="llama", seq=64, steps=60)
    assert workload.batch_bytes(base, 400) < 16 * 2**20
    workload.check_model(base)
    tune = TrainConfig(model_path=str(folder), seq=32, steps=100, eval_every=25)
    tune.check()
