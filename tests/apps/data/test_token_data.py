"""TokenData: documents tokenized once into a cached, memory-mapped token file and packed
into windows; the stream, the split, the batch order, the cache and the refusals.

Most tests use small fake tokenizers (counting calls, or giving every character its own
id so that a window is recognised by its first token); one trains a real byte-level BPE.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from zeropipe.apps.data import tokens as token_data
from zeropipe.apps.data.tokens import TokenData
from zeropipe.core.errors import ZeropipeError


class CharTokenizer:
    """Every character its code point as id; EOS 0.  Counts the documents it encodes."""

    def __init__(self, vocab: int = 70_000, eos_id: int | None = 0, salt: str = "") -> None:
        self.vocab = vocab
        self.eos_id = eos_id
        self.salt = salt
        self.encoded = 0

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.encoded += len(texts)
        return [[ord(c) for c in t] for t in texts]

    def decode(self, ids: list[int]) -> str:
        return "".join("|" if i == self.eos_id else chr(i) for i in ids)

    def digest(self) -> str:
        return f"chars-{self.vocab}-{self.eos_id}-{self.salt}"


def _unique_docs(count: int, length: int) -> list[str]:
    """Documents whose characters are all different (and never 0, the EOS)."""
    return ["".join(chr(1000 + d * length + k) for k in range(length)) for d in range(count)]


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "other": d[::-1]}) + "\n" for d in docs))
    return path


def _build(paths: list[Path], tmp_path: Path, **kw: object) -> TokenData:
    kw.setdefault("tokenizer", None)
    kw.setdefault("seq", 4)
    kw.setdefault("progress", None)
    return TokenData.build([str(p) for p in paths], cache_dir=tmp_path / "cache", **kw)  # type: ignore[arg-type]


def _window(data: TokenData, row: torch.Tensor) -> int:
    """The window a batch row came from (windows of _unique_docs start with distinct ids)."""
    matches = [
        w
        for w in range(data.windows)
        if torch.equal(data.tokens[w * data.seq : w * data.seq + data.seq].long(), row)
    ]
    assert len(matches) == 1, matches
    return matches[0]


def test_bytes_stream_is_the_documents_separated_by_blank_lines(tmp_path: Path) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("hello world\nsecond line\n", encoding="utf-8")
    docs = ["first row", "zweite Zeile: äöü €", "", "third"]
    jl = _jsonl(tmp_path / "b.jsonl", docs)
    data = _build([txt, jl], tmp_path, seq=5)
    expected = b"".join(d.encode() + b"\n\n" for d in ["hello world\nsecond line\n", *docs] if d)
    assert data.tokens.dtype == torch.uint8
    assert bytes(data.tokens.tolist()) == expected
    assert data.vocab == 256 and data.documents == 4 and data.files == 2
    assert data.windows == (len(expected) - 1) // 5
    assert data.val_windows == max(1, round(0.1 * data.windows))
    assert data.train_windows + data.val_windows == data.windows
    assert data.decode(data.tokens[:11].long()) == "hello world"
    x, y = data.batch(0, 3, 5)
    assert x.shape == y.shape == (3, 5) and x.dtype == y.dtype == torch.int64
    # The targets are the inputs shifted by one: row r is window w's tokens [w*5, w*5 + 6).
    stream = torch.tensor(list(expected))
    for r in range(3):
        starts = [
            w * 5 for w in range(data.windows) if torch.equal(stream[w * 5 : w * 5 + 5], x[r])
        ]
        assert any(torch.equal(stream[s + 1 : s + 6], y[r]) for s in starts)
    assert "2 files, 4 documents" in data.describe()


def test_held_out_windows_are_the_tail_and_disjoint_from_training(tmp_path: Path) -> None:
    jl = _jsonl(tmp_path / "d.jsonl", _unique_docs(10, 23))
    data = _build([jl], tmp_path, tokenizer=CharTokenizer(), seq=8, eval_fraction=0.2)
    assert data.tokens.dtype == torch.int32  # a vocabulary over 65,536
    n = 10 * 24
    assert data.tokens.numel() == n and data.windows == (n - 1) // 8
    assert data.val_windows == round(0.2 * data.windows)
    val = [_window(data, data.batch(k, 1, 8, split="val")[0][0]) for k in range(data.val_windows)]
    assert val == list(range(data.train_windows, data.windows))
    # Held-out batches wrap around, in order.
    x, _ = data.batch(0, data.val_windows + 2, 8, split="val")
    assert [_window(data, r) for r in x] == [*val, *val[:2]]
    x, _ = data.batch(0, data.train_windows, 8)
    train = {_window(data, r) for r in x}
    assert train == set(range(data.train_windows)) and not train & set(val)


def test_every_training_window_is_read_once_per_epoch(tmp_path: Path) -> None:
    jl = _jsonl(tmp_path / "d.jsonl", _unique_docs(7, 30))
    data = _build([jl], tmp_path, tokenizer=CharTokenizer(), seq=6, eval_fraction=0.1)
    n_train = data.train_windows
    rows = torch.cat([data.batch(step, 4, 6, seed=3)[0] for step in range(2 * n_train // 4 + 1)])
    order = [_window(data, r) for r in rows[: 2 * n_train]]
    first, second = order[:n_train], order[n_train:]
    assert sorted(first) == sorted(second) == list(range(n_train))
    assert first != second, "each epoch draws its own permutation"
    assert first != sorted(first), "the windows are shuffled"
    other = [_window(data, r) for r in data.batch(0, n_train, 6, seed=4)[0]]
    assert other != first, "another seed, another order"


def test_batches_depend_only_on_seed_step_and_split(tmp_path: Path) -> None:
    jl = _jsonl(tmp_path / "d.jsonl", _unique_docs(6, 40))
    one = _build([jl], tmp_path, tokenizer=CharTokenizer(), seq=8)
    two = _build([jl], tmp_path, tokenizer=CharTokenizer(), seq=8)
    for path in (tmp_path / "cache").iterdir():
        path.unlink()
    rebuilt = _build([jl], tmp_path, tokenizer=CharTokenizer(), seq=8)
    assert not rebuilt.cached
    for step in (5, 0, 17, 3):  # out of order: resuming must not depend on what came before
        for split in ("train", "val"):
            a = one.batch(step, 3, 8, seed=1, split=split)
            for other in (two, rebuilt):
                b = other.batch(step, 3, 8, seed=1, split=split)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_documents_are_separated_by_eos_and_decode_back(tmp_path: Path) -> None:
    tokenizer_mod = pytest.importorskip("zeropipe.apps.data.tokenizer")
    pytest.importorskip("tokenizers")
    docs = [
        f"document {k}: the quick brown fox jumps over the lazy dog {k * 7}." for k in range(40)
    ]
    jl = _jsonl(tmp_path / "d.jsonl", docs)
    tok = tokenizer_mod.train_tokenizer([jl], 300, tmp_path / "tok", progress=None)
    data = _build([jl], tmp_path, tokenizer=tok, seq=16)
    assert data.vocab == tok.vocab and data.tokens.dtype == torch.uint16
    stream = data.tokens.tolist()
    assert stream[-1] == tok.eos_id and stream.count(tok.eos_id) == len(docs)
    pieces, piece = [], []
    for i in stream:
        if i == tok.eos_id:
            pieces.append(piece)
            piece = []
        else:
            piece.append(i)
    assert [tok.decode(p) for p in pieces] == docs
    assert data.decode(torch.tensor(pieces[0])) == docs[0]


def test_a_second_build_reads_the_cache(tmp_path: Path) -> None:
    jl = _jsonl(tmp_path / "d.jsonl", _unique_docs(5, 20))
    tok = CharTokenizer()
    lines: list[str] = []
    first = _build([jl], tmp_path, tokenizer=tok, progress=lines.append)
    assert tok.encoded == 5 and not first.cached
    assert len(lines) == 1 and lines[0].startswith("tokenized 5 documents, 105 tokens")
    assert "tokenized now" in first.describe()
    lines.clear()
    second = _build([jl], tmp_path, tokenizer=tok, progress=lines.append)
    assert tok.encoded == 5 and second.cached and lines == []
    assert f"cached in {tmp_path / 'cache'}" in second.describe()
    assert torch.equal(first.tokens, second.tokens)
    # Another seq packs the same cached tokens.
    assert _build([jl], tmp_path, tokenizer=tok, seq=7).cached and tok.encoded == 5
    names = sorted(p.suffix for p in (tmp_path / "cache").iterdir())
    assert names == [".json", ".lock", ".tokens"], "no temporary file is left behind"
    meta = json.loads(first.path.with_suffix(".json").read_text())
    assert meta["n_tokens"] == 105 and meta["documents"] == 5 and meta["eos"] == 0
    assert meta["dtype"] == "int32" and meta["sources"][0][0] == str(jl.resolve())


def test_a_changed_file_or_tokenizer_or_field_is_tokenized_again(tmp_path: Path) -> None:
    jl = _jsonl(tmp_path / "d.jsonl", _unique_docs(5, 20))
    tok = CharTokenizer()
    first = _build([jl], tmp_path, tokenizer=tok)
    with jl.open("a") as fh:  # a new size
        fh.write(json.dumps({"text": "more", "other": "x"}) + "\n")
    assert not _build([jl], tmp_path, tokenizer=tok).cached and tok.encoded == 11
    st = jl.stat()
    os.utime(jl, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the same size, touched
    assert not _build([jl], tmp_path, tokenizer=tok).cached and tok.encoded == 17
    assert not _build([jl], tmp_path, tokenizer=CharTokenizer(salt="v2")).cached
    other = _build([jl], tmp_path, tokenizer=tok, text_field="other")
    assert not other.cached and other.path != first.path
    assert other.decode(other.tokens[:20].long()) == _unique_docs(5, 20)[0][::-1]


def test_a_truncated_token_file_is_rebuilt(tmp_path: Path) -> None:
    jl = _jsonl(tmp_path / "d.jsonl", _unique_docs(5, 20))
    tok = CharTokenizer()
    first = _build([jl], tmp_path, tokenizer=tok)
    expected = first.tokens.clone()
    del first
    path = next((tmp_path / "cache").glob("*.tokens"))
    with path.open("r+b") as fh:
        fh.truncate(path.stat().st_size - 4)
    lines: list[str] = []
    again = _build([jl], tmp_path, tokenizer=tok, progress=lines.append)
    assert not again.cached and tok.encoded == 10 and torch.equal(again.tokens, expected)
    assert "tokenizing again" in lines[0] and "not 420" in lines[0]


def test_progress_lines_while_tokenizing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_data, "_PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(token_data, "_CHUNK", 2)
    jl = _jsonl(tmp_path / "d.jsonl", _unique_docs(5, 20))
    lines: list[str] = []
    _build([jl], tmp_path, tokenizer=CharTokenizer(), progress=lines.append)
    assert [ln.split(",")[0] for ln in lines[:3]] == [
        "tokenizing: 2 documents",
        "tokenizing: 4 documents",
        "tokenizing: 5 documents",
    ]
    assert "MB/s" in lines[0] and lines[-1].startswith("tokenized 5 documents")


def test_refusals(tmp_path: Path) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("tiny")
    with pytest.raises(ZeropipeError, match=r"1 window of 4 tokens.*shorter --seq"):
        _build([txt], tmp_path, seq=4)  # 6 tokens: one window
    txt.write_text("x" * 30)
    with pytest.raises(ZeropipeError, match="no text"):
        _build([_jsonl(tmp_path / "e.jsonl", ["", ""])], tmp_path)
    with pytest.raises(ZeropipeError, match="end-of-text token"):
        _build([txt], tmp_path, tokenizer=CharTokenizer(eos_id=None))
    with pytest.raises(ZeropipeError, match=r"id 120 for document 0.*vocabulary of 100"):
        _build([txt], tmp_path, tokenizer=CharTokenizer(vocab=100))
    with pytest.raises(ZeropipeError, match="does not exist"):
        _build([tmp_path / "missing.txt"], tmp_path)
    with pytest.raises(ZeropipeError, match="eval_fraction"):
        _build([txt], tmp_path, eval_fraction=1.0)
    data = _build([txt], tmp_path, seq=4)
    with pytest.raises(ZeropipeError, match=r"windows of 8 tokens.*packed into windows of 4"):
        data.batch(0, 2, 8)
    with pytest.raises(ZeropipeError, match="'test'"):
        data.batch(0, 2, 4, split="test")
    with pytest.raises(ZeropipeError, match=r"2 window.*2 would be held out"):
        _build([txt], tmp_path, seq=14, eval_fraction=0.9)


def _resident() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_batches_read_the_token_file_without_loading_it(tmp_path: Path) -> None:
    txt = tmp_path / "big.txt"
    size = 40_000_000
    txt.write_bytes(b"0123456789abcdef" * (size // 16))
    _build([txt], tmp_path, seq=128)  # tokenize (and warm up the ops a batch uses)
    _build([txt], tmp_path, seq=128).batch(0, 1, 128)
    before = _resident()
    data = _build([txt], tmp_path, seq=128)
    assert data.cached and data.tokens.numel() == size + 2
    loaded = _resident() - before
    assert loaded < size // 20, f"RSS grew {loaded / 1e6:.1f} MB opening a {size // 10**6} MB file"
    assert str(data.path) in Path("/proc/self/maps").read_text(), "the token file is mapped"
    # A page-cache folio may be mapped whole (2 MB here) when one window of it is read, so
    # a few windows, not many: reading them must not bring in the rest of the file.
    data.batch(0, 2, 128)
    data.batch(0, 1, 128, split="val")
    grown = _resident() - before
    assert grown < size // 2, (
        f"RSS grew {grown / 1e6:.1f} MB reading 3 windows of {size // 10**6} MB"
    )


def test_two_builds_at_once_leave_one_whole_cache(tmp_path: Path) -> None:
    import threading
    import time

    class Slow(CharTokenizer):
        def encode_batch(self, texts: list[str]) -> list[list[int]]:
            time.sleep(0.05)  # both builds are writing their temporary files at once
            return super().encode_batch(texts)

    jl = _jsonl(tmp_path / "d.jsonl", _unique_docs(5, 20))
    built: list[TokenData] = []
    threads = [
        threading.Thread(target=lambda: built.append(_build([jl], tmp_path, tokenizer=Slow())))
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 2 and torch.equal(built[0].tokens, built[1].tokens)
    # One tokenized, the other waited for the lock and read the cache.
    assert sorted(b.cached for b in built) == [False, True]
    files = sorted(p.suffix for p in (tmp_path / "cache").iterdir())
    assert files == [".json", ".lock", ".tokens"]
    assert _build([jl], tmp_path, tokenizer=CharTokenizer()).cached


def test_document_positions_restart_after_every_eos() -> None:
    from zeropipe.apps.data.packing import document_positions

    ids = torch.tensor([[5, 6, 0, 7, 8, 9, 0, 4], [0, 1, 2, 0, 0, 3, 4, 5]])
    assert document_positions(ids, 0).tolist() == [
        [0, 1, 2, 0, 1, 2, 3, 0],  # the eos ends its document; the next starts after it
        [0, 0, 1, 2, 0, 0, 1, 2],  # a row's first token starts one, wherever it falls
    ]


def test_a_hugging_face_models_data_rows_mask_documents_apart(tmp_path: Path) -> None:
    # What zeropipe train feeds a Hugging Face model from --data: position ids per document,
    # each document's first token unpredicted; --cross-documents (and the GPT) as before.
    from types import SimpleNamespace

    from zeropipe.apps.data.packing import document_positions
    from zeropipe.apps.train.workload import batch

    docs = _unique_docs(6, 5)
    data = _build([_jsonl(tmp_path / "d.jsonl", docs)], tmp_path, tokenizer=CharTokenizer(), seq=8)
    cfg = SimpleNamespace(
        model="llama", batch_size=2, seq=8, seed=0, device="cpu", cross_documents=False
    )
    x, labels = batch(data, cfg, 0)  # type: ignore[arg-type]
    assert isinstance(x, dict) and set(x) == {"input_ids", "position_ids"}
    ids = x["input_ids"]
    assert torch.equal(x["position_ids"], document_positions(ids, 0))
    starts = x["position_ids"] == 0
    assert starts[:, 1:].any()  # the windows do hold a document boundary
    assert torch.equal(labels, ids.masked_fill(starts, -100))
    plain_x, plain_y = batch(data, SimpleNamespace(**{**vars(cfg), "cross_documents": True}), 0)  # type: ignore[arg-type]
    assert torch.equal(plain_x, ids) and torch.equal(plain_y, ids)
    gpt_x, gpt_y = batch(data, SimpleNamespace(**{**vars(cfg), "model": "gpt"}), 0)  # type: ignore[arg-type]
    assert isinstance(gpt_x, torch.Tensor) and not torch.equal(gpt_y, gpt_x)  # next tokens
