"""``zeropipe tokenizer`` and zeropipe.apps.data.tokenizer: a byte-level BPE trained on generated
text round-trips any UTF-8 exactly, compresses it, is the same bytes when trained twice, and
loads in ``transformers.AutoTokenizer`` with the same ids; the documents of .txt, .jsonl and
.parquet files and folders are read in order, and bad input is refused naming the file, the
line and the fix.  The command runs without torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from zeropipe.apps.cli import main
from zeropipe.apps.data.corpus import Corpus
from zeropipe.apps.data.tokenizer import (
    TextTokenizer,
    data_files,
    iter_documents,
    train_tokenizer,
)
from zeropipe.core.errors import ZeropipeError

SAMPLE = "héllo ✓ wörld\n\ttabs  and  spaces, 日本語 and emoji 🙂 at the end."


@pytest.fixture(scope="module")
def text() -> str:
    corpus = Corpus.generate(chars=50_000)
    return corpus.decode(corpus.tokens)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, text: str) -> list[Path]:
    folder = tmp_path_factory.mktemp("data")
    (folder / "a.txt").write_text(text[:30_000], encoding="utf-8")
    rows = [{"text": s, "id": i} for i, s in enumerate(text[30_000:].split(". "))]
    (folder / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return [folder / "a.txt", folder / "b.jsonl"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, data: list[Path]) -> TextTokenizer:
    return train_tokenizer(data, 400, tmp_path_factory.mktemp("tok") / "out", progress=None)


def test_trained_tokenizer_round_trips_and_compresses(trained: TextTokenizer, text: str) -> None:
    assert trained.vocab == 400
    assert trained.eos_id == 0
    pieces = [text[:2000], SAMPLE, "", "<|endoftext|> is text here"]
    encoded = trained.encode_batch(pieces)
    for s, ids in zip(pieces, encoded, strict=True):
        assert trained.decode(ids) == s
        assert all(0 <= i < trained.vocab for i in ids)
    # no special tokens added, and the EOS string in text is the EOS token (an added token)
    assert encoded[2] == []
    assert encoded[3][0] == 0
    # the sentences it learned from: well under half a token per byte
    assert len(encoded[0]) < 0.5 * len(pieces[0].encode())


def test_training_prints_a_line_at_start_and_end(tmp_path: Path, data: list[Path]) -> None:
    lines: list[str] = []
    train_tokenizer(data, 300, tmp_path / "out", progress=lines.append)
    assert lines[0] == (
        "zeropipe tokenizer: training a byte-level BPE of 300 tokens on 2 files (0.1 MiB)"
    )
    assert lines[-1].startswith(f"zeropipe tokenizer: wrote {tmp_path / 'out' / 'tokenizer.json'}")
    assert "300 tokens" in lines[-1]
    assert len(lines) == 2


def test_training_is_deterministic(
    tmp_path: Path, data: list[Path], trained: TextTokenizer
) -> None:
    again = train_tokenizer(data, 400, tmp_path / "again", progress=None)
    assert again.path.read_bytes() == trained.path.read_bytes()
    assert again.digest() == trained.digest()
    other = train_tokenizer(data, 300, tmp_path / "other", progress=None)
    assert other.digest() != trained.digest()


def test_autotokenizer_loads_the_folder_with_the_same_ids(trained: TextTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    folder = trained.path.parent
    assert sorted(p.name for p in folder.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert hf.eos_token == "<|endoftext|>"
    assert hf.eos_token_id == trained.eos_id == 0
    [ids] = trained.encode_batch([SAMPLE])
    assert hf(SAMPLE, add_special_tokens=False)["input_ids"] == ids
    assert hf.decode(ids) == SAMPLE


def test_load_a_folder_or_the_file(trained: TextTokenizer) -> None:
    by_folder = TextTokenizer.load(trained.path.parent)
    by_file = TextTokenizer.load(str(trained.path))
    assert by_folder.path == by_file.path == trained.path
    assert by_folder.digest() == by_file.digest() == trained.digest()
    assert by_file.encode_batch([SAMPLE]) == trained.encode_batch([SAMPLE])


def test_eos_from_the_config_beside_it_or_a_known_token(
    tmp_path: Path, trained: TextTokenizer
) -> None:
    (tmp_path / "tokenizer.json").write_bytes(trained.path.read_bytes())
    # the config names a token of the vocabulary, as a dict the way some models write it
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "Ġ"}}))
    tok = TextTokenizer.load(tmp_path)
    assert tok.eos_id is not None and tok.decode([tok.eos_id]) == " "
    assert tok.digest() != trained.digest()  # the same bytes, another EOS: other tokens
    (tmp_path / "tokenizer_config.json").unlink()
    assert TextTokenizer.load(tmp_path).eos_id == 0  # <|endoftext|> by name


def test_load_refuses_a_slow_tokenizer_a_missing_path_and_bad_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    with pytest.raises(ZeropipeError, match=r"tokenizer\.model but no tokenizer\.json.*save_pre"):
        TextTokenizer.load(tmp_path)
    with pytest.raises(ZeropipeError, match="does not exist"):
        TextTokenizer.load(tmp_path / "nowhere")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ZeropipeError, match=r"bad/tokenizer\.json is not a tokenizers"):
        TextTokenizer.load(tmp_path / "bad")


def test_save_copies_the_files_and_writes_a_config_where_none_was(
    tmp_path: Path, trained: TextTokenizer
) -> None:
    written = trained.save(tmp_path / "copy")
    assert sorted(written) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    for name in written:
        assert (tmp_path / "copy" / name).read_bytes() == (trained.path.parent / name).read_bytes()
    bare = tmp_path / "bare.json"
    bare.write_bytes(trained.path.read_bytes())
    assert TextTokenizer.load(bare).save(tmp_path / "made") == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((tmp_path / "made" / "tokenizer_config.json").read_text())
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "made"))
    assert hf.eos_token_id == 0
    assert hf(SAMPLE, add_special_tokens=False)["input_ids"] == trained.encode_batch([SAMPLE])[0]


# -- the documents ------------------------------------------------------------------------
def _parquet(path: Path, column: str, values: list[str | None]) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({column: values, "n": list(range(len(values)))}), path)


def test_documents_of_each_kind_and_of_a_folder_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "sub").mkdir()
    (tmp_path / "d" / "b.txt").write_text("whole file\nis one document\n", encoding="utf-8")
    (tmp_path / "d" / "a.jsonl").write_text('{"body": "one"}\n\n{"body": "two ✓"}\n')
    _parquet(tmp_path / "d" / "sub" / "c.parquet", "body", ["three", "four"])
    (tmp_path / "d" / "notes.md").write_text("not data")
    (tmp_path / "d" / ".hidden.txt").write_text("not data either")
    files = data_files([tmp_path / "d"])
    assert [p.relative_to(tmp_path / "d").as_posix() for p in files] == [
        "a.jsonl",
        "b.txt",
        "sub/c.parquet",
    ]
    assert list(iter_documents([tmp_path / "d"], text_field="body")) == [
        "one",
        "two ✓",
        "whole file\nis one document\n",
        "three",
        "four",
    ]
    # a file named twice is read once
    assert data_files([tmp_path / "d" / "b.txt", tmp_path / "d"])[0].name == "b.txt"
    assert len(data_files([tmp_path / "d" / "b.txt", tmp_path / "d"])) == 3


def test_documents_are_refused_naming_file_line_and_fix(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "fine"}\n\n{"body": "no text"}\n')
    with pytest.raises(
        ZeropipeError, match=r"rows\.jsonl, line 3 has no string field 'text'.*--text-field"
    ):
        list(iter_documents([rows]))
    (tmp_path / "arr.json").write_text('[{"text": "a"},\n{"text": "b"}]\n')
    with pytest.raises(ZeropipeError, match=r"arr\.json, line 1 is not JSON.*JSON lines"):
        list(iter_documents([tmp_path / "arr.json"]))
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf" + "é".encode("latin-1"))
    with pytest.raises(ZeropipeError, match=r"latin\.txt is not UTF-8 text \(byte 3\)"):
        list(iter_documents([latin]))
    _parquet(tmp_path / "p.parquet", "body", ["x"])
    with pytest.raises(ZeropipeError, match=r"no column 'text' \(columns: body, n\).*--text-field"):
        list(iter_documents([tmp_path / "p.parquet"]))
    with pytest.raises(ZeropipeError, match=r"missing\.txt does not exist"):
        data_files([tmp_path / "missing.txt"])
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.csv").write_text("a,b\n")
    with pytest.raises(ZeropipeError, match=r"empty is a folder with no \.txt"):
        data_files([tmp_path / "empty"])
    # Named outright, a file of another suffix is text (a README.md); in a folder, skipped.
    assert list(iter_documents([tmp_path / "empty" / "x.csv"])) == ["a,b\n"]


def test_a_bad_row_stops_training_with_its_error(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ZeropipeError, match="line 2"):
        train_tokenizer([rows], 300, tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()


# -- refusals and the command line --------------------------------------------------------
@pytest.mark.parametrize("vocab", [0, 256, 1_000_001])
def test_a_vocabulary_out_of_range_is_refused(tmp_path: Path, data: list[Path], vocab: int) -> None:
    with pytest.raises(ZeropipeError, match="257 to 1,000,000 tokens"):
        train_tokenizer(data, vocab, tmp_path / "out", progress=None)


def test_an_existing_tokenizer_is_kept_without_force(
    tmp_path: Path, data: list[Path], trained: TextTokenizer
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a model folder without a tokenizer: fine
    train_tokenizer(data, 300, out, progress=None)
    before = (out / "tokenizer.json").read_bytes()
    with pytest.raises(ZeropipeError, match=r"already holds a tokenizer\.json.*--force"):
        train_tokenizer(data, 400, out, progress=None)
    assert (out / "tokenizer.json").read_bytes() == before
    train_tokenizer(data, 400, out, progress=None, force=True)
    assert (out / "tokenizer.json").read_bytes() == trained.path.read_bytes()
    assert (out / "config.json").read_text() == "{}"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_command_line(
    tmp_path: Path, data: list[Path], trained: TextTokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = str(data[0].parent)
    code = main(["tokenizer", "--data", folder, "--vocab", "400", "--out", str(tmp_path / "t")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert (tmp_path / "t" / "tokenizer.json").read_bytes() == trained.path.read_bytes()
    assert "training a byte-level BPE of 400 tokens on 2 files" in out
    code = main(["tokenizer", "--data", folder, "--vocab", "100", "--out", str(tmp_path / "u")])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("zeropipe: error: --vocab 100: a byte-level BPE has 257 to")
    assert not (tmp_path / "u").exists()
    code = main(["tokenizer", "--vocab", "400", "--out", str(tmp_path / "u")])
    assert code == 2
    assert "--data" in capsys.readouterr().err


def test_a_long_training_reports_the_documents_read(
    tmp_path: Path, data: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from zeropipe.apps.data import tokenizer

    monkeypatch.setattr(tokenizer, "_PROGRESS_EVERY_S", 0.0)  # every document is "10 s later"
    lines: list[str] = []
    train_tokenizer(data[:1], 300, tmp_path / "out", progress=lines.append)
    assert lines[1] == "zeropipe tokenizer: 1 document read (0.0 M characters)"
    assert len(lines) == 3
