"""Tokenizers: train a byte-level BPE on your text (``zeropipe tokenizer``), load any
``tokenizer.json``, and read the documents that both training and token packing take.

    data_files(paths)              --data's files: folders walked (sorted, recursively), each
                                   file a .txt, .jsonl / .json or .parquet, missing ones named
    iter_documents(paths, field)   their documents, one at a time: a whole .txt file, a JSON
                                   line's ``field``, a parquet row's ``field`` column
    has_text(doc), no_text_message(files, field, documents)
                                   whether a document holds text (not only whitespace), and
                                   the one line that refuses data none of whose documents do
    train_tokenizer(files, vocab, out)
                                   a byte-level BPE (GPT-2's scheme: any UTF-8 encodes, nothing
                                   is unknown) with ``<|endoftext|>`` as id 0 and end of
                                   document, written into ``out`` as tokenizer.json plus the
                                   two files ``transformers.AutoTokenizer`` reads beside it
    TextTokenizer.load(where)      a tokenizer.json, or an HF folder holding one: encode,
                                   decode, its end-of-document id, a digest to key caches on

It is a thin layer over Hugging Face ``tokenizers`` (the Rust library), imported only when
used; nothing here needs torch.  Training streams the documents (``train_from_iterator``), so the data is never held
whole, and it is deterministic: the same files and vocabulary give the same tokenizer.json
bytes.  The result is written into a hidden sibling folder first and moved into ``out``, so an
interrupted run leaves no half-written tokenizer behind.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from zeropipe.core.errors import ZeropipeError

__all__ = [
    "EOS_CANDIDATES",
    "SUFFIXES",
    "TextTokenizer",
    "add_tokenizer_arguments",
    "data_files",
    "has_text",
    "iter_documents",
    "no_text_message",
    "run_tokenizer",
    "train_tokenizer",
]

#: What ``--data`` reads; a folder's other files are skipped.
SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
#: End-of-document tokens of common vocabularies, in the order looked for when the
#: tokenizer_config.json beside a tokenizer.json names none.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")

_TOKENIZER = "tokenizer.json"
_CONFIG = "tokenizer_config.json"
_SPECIAL = "special_tokens_map.json"
# Tokenizer files of the slow (Python) tokenizers, which tokenizers cannot read.
_SLOW_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
_EOS = "<|endoftext|>"
_MIN_VOCAB = 256 + 1  # the byte alphabet, and <|endoftext|>
_MAX_VOCAB = 1_000_000
_PROGRESS_EVERY_S = 10.0
_MIB = 1024 * 1024
_FAST_HINT = (
    "save a fast tokenizer first: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR) "
    "writes tokenizer.json"
)


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise ZeropipeError(
            "tokenizers are read and trained with Hugging Face tokenizers, which is not "
            "installed; pip install 'zeropipe[data]'"
        ) from None
    return tokenizers


# -- the documents ----------------------------------------------------------------------
def data_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The files ``paths`` name, folders walked recursively in sorted order (hidden entries
    and other suffixes skipped), each file once; a missing path or a folder with none of
    :data:`SUFFIXES` is refused.  A file named outright is read whatever its suffix: one that
    is not .jsonl, .json or .parquet as text (a README.md, a notes file)."""
    if not paths:
        raise ZeropipeError(f"no data given; name files or folders of {', '.join(SUFFIXES)}")
    found: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            inside = sorted(
                p
                for p in path.rglob("*")
                if p.suffix.lower() in SUFFIXES
                and p.is_file()
                # .git, editor backups, our own temporary folders: never data
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not inside:
                raise ZeropipeError(
                    f"--data {path} is a folder with no {', '.join(SUFFIXES)} file in it; "
                    f"point at the folder that holds them"
                )
            found.extend(inside)
        elif path.is_file():
            found.append(path)
        else:
            raise ZeropipeError(f"--data {path} does not exist")
    seen: set[Path] = set()
    unique = []
    for p in found:  # a file named and also inside a named folder is read once
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def iter_documents(
    paths: Sequence[str | os.PathLike[str]], text_field: str = "text"
) -> Iterator[str]:
    """The documents of :func:`data_files` ``(paths)``, in order: a .txt file (or one named
    outright with another suffix) is one document (UTF-8), a .jsonl / .json line one (its
    ``text_field`` string; empty lines skipped), a parquet row one (its ``text_field``
    column)."""
    for path in data_files(paths):
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            yield from _parquet_documents(path, text_field)
        elif suffix in (".jsonl", ".json"):
            yield from _json_documents(path, text_field)
        else:
            yield _read_text(path)


def has_text(doc: str) -> bool:
    """Whether a document holds anything but whitespace (``isspace`` copies nothing)."""
    return bool(doc) and not doc.isspace()


def no_text_message(files: Sequence[Path], text_field: str, documents: int) -> str:
    """Why ``files``, which gave ``documents`` documents (rows and plain files alike) none of
    which :func:`has_text`, cannot be trained on: a plain file is empty or whitespace, a
    .jsonl / .json / .parquet file has no rows or its rows' ``text_field`` is empty."""
    names = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
    holds = f"--data {names} {'holds' if len(files) == 1 else 'hold'} no text"
    plain = sum(Path(f).suffix.lower() not in (".jsonl", ".json", ".parquet") for f in files)
    if plain == len(files):
        return f"{holds} (empty or only whitespace); give a file with text"
    if documents <= plain:  # not one row in the row files
        return f"{holds}: no rows (empty, or only blank lines); give a file with rows of text"
    return (
        f"{holds}: every row's {text_field!r} field is empty or whitespace; give --text-field "
        f"if the text is in another field"
    )


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ZeropipeError(f"--data {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ZeropipeError(
            f"--data {path} is not UTF-8 text (byte {exc.start}); convert it "
            f"(iconv -t UTF-8) or leave it out"
        ) from None


def _json_documents(path: Path, field: str) -> Iterator[str]:
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise ZeropipeError(f"--data {path}: {exc.strerror or exc}") from None
    with fh:
        for number, raw in enumerate(fh, 1):
            where = f"--data {path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ZeropipeError(f"{where} is not UTF-8 (byte {exc.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ZeropipeError(
                    f"{where} is not JSON ({exc.msg}); each line must be one JSON object "
                    f"(JSON lines, not one array or one pretty-printed object)"
                ) from None
            text = row.get(field) if isinstance(row, dict) else None
            if not isinstance(text, str):
                has = f"keys: {', '.join(map(str, row))}" if isinstance(row, dict) else "no object"
                raise ZeropipeError(
                    f"{where} has no string field {field!r} ({has}); name the field that holds "
                    f"the text with --text-field"
                )
            yield text


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow as pa  # type: ignore[import-untyped]
        import pyarrow.parquet as pq  # type: ignore[import-untyped]
    except ImportError:
        raise ZeropipeError(
            f"--data {path}: parquet files are read with pyarrow, which is not installed; "
            f"pip install 'zeropipe[data]'"
        ) from None
    try:
        table = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise ZeropipeError(f"--data {path} is not a readable parquet file ({exc})") from None
    schema = table.schema_arrow
    if field not in schema.names:
        raise ZeropipeError(
            f"--data {path} has no column {field!r} (columns: {', '.join(schema.names)}); "
            f"name the column that holds the text with --text-field"
        )
    kind = schema.field(field).type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
        raise ZeropipeError(
            f"--data {path}: column {field!r} holds {kind}, not text; name the column that "
            f"holds the text with --text-field"
        )
    row = 0
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is None:
                raise ZeropipeError(
                    f"--data {path}: row {row} of column {field!r} is null; drop empty rows"
                )
            row += 1
            yield text


# -- a tokenizer ------------------------------------------------------------------------
class TextTokenizer:
    """A tokenizer.json loaded with HF tokenizers."""

    def __init__(self, path: Path, raw: bytes, tokenizer: Any) -> None:
        self.path = path  #: the tokenizer.json it was read from
        self._raw = raw
        self._tokenizer = tokenizer
        self._eos_token = self._find_eos()

    @classmethod
    def load(cls, where: str | os.PathLike[str]) -> TextTokenizer:
        """The tokenizer of ``where``: a tokenizer.json, or a folder holding one (an HF
        model folder)."""
        path = Path(where)
        if path.is_dir():
            if not (path / _TOKENIZER).is_file():
                slow = [n for n in _SLOW_FILES if (path / n).is_file()]
                if slow:
                    raise ZeropipeError(
                        f"{path} holds {', '.join(slow)} but no {_TOKENIZER}; {_FAST_HINT}"
                    )
                raise ZeropipeError(f"{path} holds no {_TOKENIZER}; give a folder with one")
            path = path / _TOKENIZER
        elif not path.exists():
            raise ZeropipeError(f"tokenizer {path} does not exist")
        elif path.name in _SLOW_FILES:
            raise ZeropipeError(
                f"{path} is a slow tokenizer's file, not a {_TOKENIZER}; {_FAST_HINT}"
            )
        try:
            raw = path.read_bytes()
            tokenizer = _tokenizers().Tokenizer.from_str(raw.decode("utf-8"))
        except OSError as exc:
            raise ZeropipeError(f"cannot read tokenizer {path}: {exc.strerror or exc}") from None
        except ZeropipeError:
            raise
        except Exception as exc:  # tokenizers raises a bare Exception for bad JSON
            raise ZeropipeError(
                f"{path} is not a tokenizers {_TOKENIZER} ({exc}); {_FAST_HINT}"
            ) from None
        return cls(path, raw, tokenizer)

    def _find_eos(self) -> str | None:
        config = self.path.parent / _CONFIG
        named = None
        if config.is_file():
            try:
                data = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ZeropipeError(f"{config} cannot be read as JSON ({exc})") from None
            eos = data.get("eos_token") if isinstance(data, dict) else None
            named = eos.get("content") if isinstance(eos, dict) else eos
        for token in (named, *EOS_CANDIDATES):
            if isinstance(token, str) and self._tokenizer.token_to_id(token) is not None:
                return token
        return None

    @property
    def vocab(self) -> int:
        """Tokens, added ones included: the embedding rows a model needs."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int | None:
        """The end-of-document token: tokenizer_config.json's ``eos_token`` beside the
        tokenizer.json, else the first of :data:`EOS_CANDIDATES` the vocabulary has."""
        if self._eos_token is None:
            return None
        return int(self._tokenizer.token_to_id(self._eos_token))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (documents are joined by
        :attr:`eos_id` where they are packed, not here)."""
        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [list(e.ids) for e in encoded]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; special tokens are shown, so document boundaries stay visible."""
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def digest(self) -> str:
        """sha256 of the tokenizer.json bytes and the EOS id: equal digests, equal tokens (a
        cache key)."""
        h = hashlib.sha256(self._raw)
        h.update(f"\neos={self.eos_id}".encode())
        return h.hexdigest()

    def save(self, out_dir: str | os.PathLike[str]) -> list[str]:
        """Write tokenizer.json and the tokenizer_config.json / special_tokens_map.json beside
        it into ``out_dir`` (a tokenizer_config.json is made when there is none, so that
        ``AutoTokenizer.from_pretrained(out_dir)`` loads it); return the names written."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        source = self.path.parent
        written = [_TOKENIZER]
        if (out / _TOKENIZER).resolve() != self.path.resolve():
            (out / _TOKENIZER).write_bytes(self._raw)
        for name in (_CONFIG, _SPECIAL):
            if (source / name).is_file():
                if (out / name).resolve() != (source / name).resolve():
                    shutil.copyfile(source / name, out / name)
                written.append(name)
        if _CONFIG not in written:
            config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
            if self._eos_token is not None:
                config["eos_token"] = self._eos_token
            _write_json(out / _CONFIG, config)
            written.append(_CONFIG)
        return written


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


# -- training ---------------------------------------------------------------------------
def train_tokenizer(
    files: Sequence[str | os.PathLike[str]],
    vocab: int,
    out: str | os.PathLike[str],
    *,
    text_field: str = "text",
    progress: Callable[[str], None] | None = print,
    force: bool = False,
) -> TextTokenizer:
    """Train a byte-level BPE of ``vocab`` tokens on ``files`` and write it into ``out`` (see
    the module); ``progress`` gets a line at the start, every 10 s or so, and at the end."""
    if (
        isinstance(vocab, bool)
        or not isinstance(vocab, int)
        or not (_MIN_VOCAB <= vocab <= _MAX_VOCAB)
    ):
        raise ZeropipeError(
            f"--vocab {vocab}: a byte-level BPE has {_MIN_VOCAB} to {_MAX_VOCAB:,} tokens (256 "
            f"bytes and <|endoftext|> at least); give a vocabulary in that range"
        )
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ZeropipeError(f"--out {out} is a file; give a folder")
    _check_out_beside(out, files)
    if (out / _TOKENIZER).exists() and not force:
        raise ZeropipeError(
            f"--out {out} already holds a {_TOKENIZER}; give another folder or --force"
        )
    paths = data_files(files)
    say = progress or (lambda line: None)
    size = sum(p.stat().st_size for p in paths)
    say(
        f"zeropipe tokenizer: training a byte-level BPE of {vocab} tokens on {len(paths)} "
        f"file{'s' * (len(paths) != 1)} ({size / _MIB:.1f} MiB)"
    )
    tk = _tokenizers()
    started = time.monotonic()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[_EOS],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    reader = _Reader(iter_documents(paths, text_field), say, started)
    tokenizer.train_from_iterator(reader, trainer=trainer)
    if reader.with_text == 0:  # else a tokenizer of the bare byte alphabet, learnt from nothing
        raise ZeropipeError(no_text_message(paths, text_field, reader.documents))
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tokenizer.save(str(tmp / _TOKENIZER))
        specials = {"bos_token": _EOS, "eos_token": _EOS, "unk_token": _EOS}
        # Without it, transformers' decode would join " ." into "." and not round-trip.
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "clean_up_tokenization_spaces": False,
        }
        _write_json(tmp / _CONFIG, config)
        _write_json(tmp / _SPECIAL, specials)
        out.mkdir(parents=True, exist_ok=True)
        for name in (_CONFIG, _SPECIAL, _TOKENIZER):  # tokenizer.json last: it marks done
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = TextTokenizer.load(out)
    short = f" (asked {vocab}: the data held no more merges)" if result.vocab < vocab else ""
    say(
        f"zeropipe tokenizer: wrote {out / _TOKENIZER}: {result.vocab} tokens{short}, "
        f"{reader.documents:,} document{'s' * (reader.documents != 1)} in "
        f"{time.monotonic() - started:.1f} s"
    )
    return result


def _check_out_beside(out: Path, files: Sequence[str | os.PathLike[str]]) -> None:
    """Refuse an ``out`` that is, or is inside, a --data folder: the next training on that
    folder would read the tokenizer's own .json files as documents, and fail on them."""
    where = out.resolve()
    for given in files:
        folder = Path(given)
        if not folder.is_dir():
            continue
        inside = folder.resolve()
        if where == inside or inside in where.parents:
            relation = "is" if where == inside else "is inside"
            raise ZeropipeError(
                f"--out {out} {relation} the --data folder {folder}: the tokenizer's files "
                f"would be read as documents the next time {folder} is read; give another "
                f"--out, outside it"
            )


class _Reader:
    """The documents for the trainer, counted, with a progress line every 10 s."""

    def __init__(self, documents: Iterator[str], say: Callable[[str], None], started: float):
        self._documents = documents
        self._say = say
        self._last = started
        self.documents = 0
        self.with_text = 0  # documents that hold more than whitespace
        self.chars = 0

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        # A reading error (a bad line, a non-UTF-8 file) goes through the trainer unchanged
        # and ends the training at once.
        text = next(self._documents)
        self.documents += 1
        self.with_text += has_text(text)
        self.chars += len(text)
        now = time.monotonic()
        if now - self._last >= _PROGRESS_EVERY_S:
            self._last = now
            self._say(
                f"zeropipe tokenizer: {self.documents:,} "
                f"document{'s' * (self.documents != 1)} read "
                f"({self.chars / 1e6:,.1f} M characters)"
            )
        return text


# -- zeropipe tokenizer -----------------------------------------------------------------
def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``zeropipe tokenizer``."""
    parser.description = (
        "Train a byte-level BPE tokenizer (any UTF-8 text encodes; <|endoftext|> is id 0 and "
        "ends each document) and write tokenizer.json, tokenizer_config.json and "
        "special_tokens_map.json into --out, a folder transformers.AutoTokenizer loads."
    )
    parser.add_argument(
        "--data",
        nargs="+",
        required=True,
        metavar="FILE_OR_DIR",
        help=f"text to train on: {', '.join(SUFFIXES)} files or folders of them (walked "
        f"recursively); a .txt file is one document, a JSON line or parquet row one",
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=4096,
        metavar="N",
        help=f"tokens in the vocabulary, {_MIN_VOCAB} to {_MAX_VOCAB:,} (default 4096)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    parser.add_argument(
        "--text-field",
        default="text",
        metavar="NAME",
        help="the JSON field / parquet column holding the text (default text)",
    )
    parser.add_argument("--force", action="store_true", help="replace a tokenizer already in --out")


def run_tokenizer(args: argparse.Namespace) -> int:
    """``zeropipe tokenizer``: train and write the tokenizer."""
    train_tokenizer(args.data, args.vocab, args.out, text_field=args.text_field, force=args.force)
    return 0
