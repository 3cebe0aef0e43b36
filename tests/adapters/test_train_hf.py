"""zeropipe train --model / --model-config / --data: one-line errors, and a short run of each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeropipe.apps.cli import main
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import train
from zeropipe.core.errors import ZeropipeError

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"width": 32, "blocks": 2, "seq": 16, "batch_size": 4, "microbatches": 2, "quiet": True}


def _files(tmp: Path) -> dict[str, str]:
    (tmp / "bert.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp / "small_vocab.json").write_text(
        json.dumps(
            {"model_type": "llama", "vocab_size": 10, "hidden_size": 16, "num_attention_heads": 2}
        )
    )
    (tmp / "bad_heads.json").write_text(
        json.dumps({"model_type": "llama", "hidden_size": 16, "num_attention_heads": 3})
    )
    (tmp / "binary.txt").write_bytes(b"\xff\xfe" * 1000)
    (tmp / "tiny.txt").write_text("hello")
    return {
        k: str(tmp / k)
        for k in ("bert.json", "small_vocab.json", "bad_heads.json", "binary.txt", "tiny.txt")
    }


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "nope"], "unknown --model 'nope'; choose gpt, llama, qwen3, gpt2"),
        (["--model", "gpt", "--model-config", "bert.json"], "leave --model out"),
        (["--model-config", "missing.json"], "--model-config missing.json: No such file"),
        (["--model-config", "bert.json"], "model_type 'bert' is not one of"),
        (["--model-config", "small_vocab.json"], "set vocab_size >= "),
        (["--model-config", "bad_heads.json"], "transformers refuses it"),
        (["--data", "missing.txt"], "--data missing.txt does not exist"),
        (["--data", "binary.txt"], "is not UTF-8 text"),
        (["--data", "tiny.txt"], "give more data or a shorter --seq"),
        (["--model", "llama", "--ranks", "9"], "use fewer ranks or more --blocks"),
    ],
)
def test_bad_model_and_data_flags_are_one_line_errors(
    argv: list[str],
    needle: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if "llama" in argv or any(a.endswith(".json") for a in argv):
        pytest.importorskip("transformers")
    _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zeropipe: error:") and needle in err[0], err


def test_a_text_file_trains_and_writes_every_output(tmp_path: Path) -> None:
    cfg = TrainConfig(ranks=1, steps=12, data=str(ROOT / "README.md"), out=str(tmp_path), **SMALL)
    summary = train(cfg)  # type: ignore[arg-type]
    assert summary["final_train_loss"] < summary["initial_eval_loss"]
    for name in ("metrics.jsonl", "loss.png", "trace.json", "timeline.png", "checkpoints"):
        assert (tmp_path / name).exists(), name


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_a_hugging_face_model_trains_and_resume_refuses_another_config(
    model: str, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    cfg = TrainConfig(ranks=1, steps=12, model=model, out=str(tmp_path), **SMALL)  # type: ignore[arg-type]
    summary = train(cfg)
    assert summary["final_train_loss"] < summary["initial_eval_loss"]
    config = tmp_path / "cfg.json"
    # Small, so that the memory check lets it through to the resume check it is about.
    small = (
        {"n_embd": 32, "n_layer": 2, "n_head": 4}
        if model == "gpt2"
        else {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 64}
    )  # fmt: skip
    config.write_text(json.dumps({"model_type": model, "vocab_size": 64, **small}))
    with pytest.raises(
        ZeropipeError,
        match=r"--model-config \S+cfg.json differs from the checkpoint's None; pass no --model-config",
    ):
        train(
            TrainConfig(
                ranks=1,
                steps=13,
                model=model,
                model_config=str(config),
                resume=True,
                out=str(tmp_path),
                **SMALL,
            )
        )  # type: ignore[arg-type]
