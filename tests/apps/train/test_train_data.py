"""``zeropipe train --data`` through a tokenizer: a .jsonl packed into ``--seq``, scored on its
held-out windows every ``--eval-every`` steps, resumed only on the same tokens, and exported
with the tokenizer it trained on.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from zeropipe.apps.data.corpus import Corpus
from zeropipe.apps.data.tokenizer import TextTokenizer, train_tokenizer
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import train
from zeropipe.apps.train.resume import check_resume
from zeropipe.core.errors import ZeropipeError

SMALL = {"width": 32, "blocks": 2, "batch_size": 4, "microbatches": 2, "quiet": True}


def _text(chars: int, seed: int) -> str:
    corpus = Corpus.generate(chars=chars, seed=seed)
    return corpus.decode(corpus.tokens)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    (root / "corpus.txt").write_text(_text(40_000, 0))
    sentences = _text(40_000, 1).split(". ")
    with open(root / "docs.jsonl", "w") as fh:
        for k in range(0, len(sentences) - 3, 3):
            fh.write(json.dumps({"body": ". ".join(sentences[k : k + 3]) + "."}) + "\n")
    train_tokenizer([root / "corpus.txt"], 300, root / "tok", progress=None)
    return {"root": root, "jsonl": root / "docs.jsonl", "tok": root / "tok"}


def test_a_tokenized_jsonl_trains_with_eval_every_and_resumes_only_on_the_same_tokens(
    files: dict[str, Path], tmp_path: Path
) -> None:
    cfg = TrainConfig(
        ranks=2, steps=6, seq=24, eval_every=2, eval_batches=2, data=str(files["jsonl"]),
        tokenizer=str(files["tok"]), text_field="body", data_cache=str(tmp_path / "cache"),
        out=str(tmp_path / "run"), checkpoint_every=3, **SMALL,  # type: ignore[arg-type]
    )  # fmt: skip
    summary = train(cfg)
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    trace = summary["trace"]  # the traced step, as run and as planned (the summary's row)
    assert 0.0 <= trace["measured_bubble"] < 1.0 and 0.0 <= trace["planned_bubble"] < 1.0
    assert trace["costs"].latency >= 0.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]
    # --eval-every 2: steps 2 and 4 carry the held-out loss, and so do the start (a row of
    # its own) and the last step (the summary's).
    assert [r["step"] for r in rows if "eval_loss" in r] == [0, 2, 4, 6]
    assert rows[0]["eval_loss"] == summary["initial_eval_loss"]
    assert rows[6]["eval_loss"] == summary["final_eval_loss"]
    assert rows[4]["eval_loss"] < summary["initial_eval_loss"]
    vocab = TextTokenizer.load(files["tok"]).vocab
    cached = list((tmp_path / "cache").glob("*.tokens"))
    assert len(cached) == 1  # tokenized once: by the launcher, read by both ranks
    ids = cached[0].read_bytes()
    assert len(ids) % 2 == 0 and vocab > 256  # uint16 ids for a vocabulary over 256

    resumed = replace(cfg, steps=8, resume=True)
    for change, flag in (({"seq": 32}, "--seq"), ({"tokenizer": None}, "--tokenizer")):
        with pytest.raises(ZeropipeError, match=flag):
            check_resume(replace(resumed, **change))  # type: ignore[arg-type]
    check_resume(resumed)  # the same tokens: accepted


def test_data_refusals_are_one_line_and_name_the_fix(
    files: dict[str, Path], tmp_path: Path
) -> None:
    base = TrainConfig(out=str(tmp_path / "o"), data_cache=str(tmp_path / "c"), **SMALL)  # type: ignore[arg-type]
    cases = [
        (replace(base, tokenizer=str(files["tok"])), "no --data is given"),
        (replace(base, data=str(files["jsonl"])), "has no string field 'text'"),
        (replace(base, data=str(tmp_path / "none.jsonl")), "none.jsonl does not exist"),
        (replace(base, data=str(files["root"] / "corpus.txt"), seq=1), "--seq must be >= 2"),
        (replace(base, eval_every=-1), "--eval-every must be >= 0"),
    ]
    for cfg, needle in cases:
        with pytest.raises(ZeropipeError) as err:
            cfg.check()
        assert needle in str(err.value) and "\n" not in str(err.value), (needle, err.value)


def test_a_preset_trained_on_a_tokenizer_exports_with_it(
    files: dict[str, Path], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from zeropipe.apps.cli import main

    cfg = TrainConfig(
        model="llama", ranks=1, steps=2, seq=16, data=str(files["jsonl"]), text_field="body",
        tokenizer=str(files["tok"]), data_cache=str(tmp_path / "cache"), out=str(tmp_path / "run"),
        **SMALL,  # type: ignore[arg-type]
    )  # fmt: skip
    train(cfg)
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "run" / "checkpoints"), str(out)]) == 0
    ours = TextTokenizer.load(files["tok"])
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert model.config.vocab_size == ours.vocab
    text = "the cat sees a warm bed."
    assert theirs(text).input_ids == ours.encode_batch([text])[0]
