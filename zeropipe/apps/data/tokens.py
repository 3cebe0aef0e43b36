"""Documents tokenized once into a memory-mapped token file, and packed into windows of
``seq`` tokens that batches address by step.

``TokenData.build(paths, tokenizer=..., seq=..., cache_dir=...)`` offers the interface of
:class:`zeropipe.apps.data.corpus.Corpus` (``vocab``, ``batch``, ``decode``), so the trainer takes
either.  The choices, each deliberate:

Tokens
    The documents come from ``zeropipe.apps.data.tokenizer.iter_documents``: a ``.txt`` file is
    one document, a ``.jsonl`` / ``.json`` / ``.parquet`` row is one (its ``text_field``).
    Empty documents are skipped; data none of whose documents holds more than whitespace is
    refused, naming the files.  With a tokenizer every document is its ids followed by the
    tokenizer's end-of-text id (a tokenizer without one is refused: nothing would tell the
    model where one document ends).  Without a tokenizer every document is its UTF-8 bytes
    (a vocabulary of 256) followed by ``"\\n\\n"``, the separator a reader of plain text
    would see.  The last document is followed by its separator too.

Packing
    The documents are concatenated, separators included, and cut into consecutive windows:
    window ``k`` covers tokens ``[k*seq, k*seq + seq + 1)``, its first ``seq`` the inputs and
    its last ``seq`` the targets, so there are ``(n_tokens - 1) // seq`` windows and nothing
    is dropped but the remainder at the end: no padding is spent.  How a model sees the
    documents inside a window (masked apart, or attention across the separator, as in
    GPT-2's pretraining) is ``zeropipe.apps.data.packing``'s.

Held-out split
    The last ``max(1, round(eval_fraction * windows))`` windows are held out
    (``split="val"``); the others train.  Too few windows for both is refused.

Order
    ``batch(step, batch_size, seq, seed, split)`` depends only on (seed, step, split), so a
    run resumed at step N reads the batches an uninterrupted run would.  Training samples
    go epoch by epoch, each epoch a permutation of the training windows drawn from a
    generator seeded by (seed, epoch); sample ``step * batch_size + j`` is at position
    ``i % n_train`` of epoch ``i // n_train``, so every window is read once per epoch.
    Held-out batches read the held-out windows in order, wrapping around.

Cache
    Tokenizing happens once.  The tokens go to ``<cache_dir>/<key>.tokens`` (raw ids:
    uint8 for a vocabulary of at most 256, uint16 up to 65,536, else int32) with
    ``<key>.json`` beside it; the key hashes the format version, every data file's path,
    size and modification time, the tokenizer's digest and the text field -- not ``seq``,
    so a new window length reuses the tokens.  Tokens are written as they are made (memory
    stays bounded for inputs larger than it) into a temporary file that is renamed into
    place, so no reader sees a torn file; and a lock (``<key>.lock``) lets one process
    tokenize while the others started beside it wait and read its cache.  A token file whose
    size does not match its json is rebuilt.  The json also holds the token file's sha256, which
    a checkpoint records (:meth:`TokenData.record`) so that a resume on data changed at the
    same paths is refused.  Reading maps the file (``torch.from_file``):
    a batch touches only its windows' pages.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from os import PathLike
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from zeropipe.core.errors import ZeropipeError

__all__ = ["TokenData", "changed_files", "data_paths", "data_vocab"]

# Bump when the token file or its json changes meaning: old caches then miss, not mislead.
# 2: the json holds the token file's sha256 (what a checkpoint records of its data).
_FORMAT = 2
_BYTES_SEPARATOR = b"\n\n"
# Documents handed to the tokenizer at once: big enough for its batching to pay, small
# enough that a large input streams through.
_CHUNK = 1000
_PROGRESS_SECONDS = 10.0
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "uint8": (torch.uint8, "B"),
    "uint16": (torch.uint16, "H"),
    "int32": (torch.int32, "i"),
}


class _Tokenizer(Protocol):
    """What TokenData needs of ``zeropipe.apps.data.tokenizer.TextTokenizer``."""

    @property
    def vocab(self) -> int: ...
    @property
    def eos_id(self) -> int | None: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: list[int]) -> str: ...
    def digest(self) -> str: ...


def _dtype_name(vocab: int) -> str:
    if vocab <= 256:
        return "uint8"
    if vocab <= 65536:
        return "uint16"
    if vocab <= 2**31:
        return "int32"
    raise ZeropipeError(f"a vocabulary of {vocab:,} ids does not fit int32 token ids")


def _count(n: float) -> str:
    """1,204 below a million, else 2.1M / 3.40B: start-up lines stay short."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{int(n):,}"


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made if missing) for the block: ``flock``, which
    the kernel drops if the holder dies.  Where there is no ``fcntl`` (Windows), no lock:
    the atomic renames still keep the cache whole, at the cost of tokenizing twice."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' if n != 1 else ''}"


def _key(sources: list[list[Any]], tokenizer_digest: str, text_field: str) -> str:
    blob = json.dumps(
        {"format": _FORMAT, "sources": sources, "tokenizer": tokenizer_digest, "text": text_field}
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _sources(files: list[Path]) -> list[list[Any]]:
    """(absolute path, size, mtime in ns) of each file, in reading order: the order makes
    the token stream, so it belongs in the key."""
    out: list[list[Any]] = []
    for f in files:
        st = Path(f).stat()
        out.append([str(Path(f).resolve()), st.st_size, st.st_mtime_ns])
    return out


class _Counted:
    """The documents passed through, counted: all of them, and those holding text."""

    def __init__(self, docs: Iterable[str], has_text: Callable[[str], bool]) -> None:
        self._docs = docs
        self._has_text = has_text
        self.documents = self.with_text = 0

    def __iter__(self) -> Iterator[str]:
        for doc in self._docs:
            self.documents += 1
            self.with_text += self._has_text(doc)
            yield doc


class _Hashed:
    """A binary file whose bytes are hashed as they are written: the token stream's sha256,
    which a checkpoint records to tell its data from data changed at the same path."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self.sha256 = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.sha256.update(data)
        self._out.write(data)


def _chunks(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        if doc:
            chunk.append(doc)
            if len(chunk) == size:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


class _Progress:
    """A line at most every ``_PROGRESS_SECONDS`` while tokenizing, and a last one."""

    def __init__(self, say: Callable[[str], None] | None) -> None:
        self.say = say
        self.start = self.last = time.monotonic()
        self.documents = self.tokens = self.bytes = 0

    def add(self, documents: int, tokens: int, size: int) -> None:
        self.documents += documents
        self.tokens += tokens
        self.bytes += size
        now = time.monotonic()
        if self.say is not None and now - self.last >= _PROGRESS_SECONDS:
            self.last = now
            self.say(f"tokenizing: {self._totals(now)}")

    def _totals(self, now: float) -> str:
        rate = self.bytes / 1e6 / max(now - self.start, 1e-9)
        return (
            f"{_plural(self.documents, 'document')}, {_count(self.tokens)} tokens, {rate:.1f} MB/s"
        )

    def done(self, where: Path) -> None:
        now = time.monotonic()
        if self.say is not None:
            self.say(
                f"tokenized {self._totals(now)} in {now - self.start:.1f} s, cached in {where}"
            )


def _write_tokens(
    out: Any,
    docs: Iterable[str],
    tokenizer: _Tokenizer | None,
    typecode: str,
    progress: _Progress,
) -> tuple[int, int]:
    """Every document's tokens and its separator, appended to ``out``: (tokens, documents)."""
    n_tokens = documents = 0
    if tokenizer is None:
        for chunk in _chunks(docs, _CHUNK):
            data = _BYTES_SEPARATOR.join(d.encode("utf-8") for d in chunk) + _BYTES_SEPARATOR
            out.write(data)
            n_tokens += len(data)
            documents += len(chunk)
            progress.add(len(chunk), len(data), len(data) - len(_BYTES_SEPARATOR) * len(chunk))
        return n_tokens, documents
    eos, vocab = tokenizer.eos_id, tokenizer.vocab
    if eos is None:
        raise ZeropipeError(
            "the tokenizer has no end-of-text token, and one is needed to separate the "
            "documents packed into a window: give a tokenizer with an EOS token (one made "
            "by 'zeropipe tokenizer' has one), or leave --tokenizer out to train on bytes"
        )
    for chunk in _chunks(docs, _CHUNK):
        encoded = tokenizer.encode_batch(chunk)
        ids = array(typecode)
        for k, doc_ids in enumerate(encoded):
            if doc_ids and (max(doc_ids) >= vocab or min(doc_ids) < 0):
                bad = next(i for i in doc_ids if not 0 <= i < vocab)
                raise ZeropipeError(
                    f"the tokenizer gave id {bad} for document {documents + k} (counting "
                    f"non-empty documents from 0), outside its vocabulary of {vocab:,}: the "
                    f"tokenizer file is inconsistent; re-make it"
                )
            ids.extend(doc_ids)
            ids.append(eos)
        out.write(ids.tobytes())
        n_tokens += len(ids)
        documents += len(chunk)
        progress.add(len(chunk), len(ids), sum(len(d.encode("utf-8")) for d in chunk))
    return n_tokens, documents


def _readers() -> tuple[Callable[..., list[Path]], Callable[..., Iterator[str]]]:
    # Imported here: the readers pull in pyarrow for .parquet, which a byte-level run of
    # plain text need not pay for at import time.
    from zeropipe.apps.data.tokenizer import data_files, iter_documents

    return data_files, iter_documents


def data_paths(spec: str) -> list[str]:
    """``zeropipe train --data``'s paths: the whole value when it names a file or folder that
    exists (a name may hold a comma), else its comma-separated pieces; a piece that does not
    exist is refused in one line that says the value was read as a comma list."""
    if Path(spec).exists():
        return [spec]
    pieces = [p for p in spec.split(",") if p.strip()]
    if len(pieces) > 1:
        for piece in pieces:
            if not Path(piece).exists():
                raise ZeropipeError(
                    f"--data {piece} does not exist: --data is a comma-separated list, and "
                    f"{spec!r} was read as {len(pieces)} paths (no file or folder is named "
                    f"{spec!r} either); give existing files or folders, separated by commas"
                )
    return pieces


def changed_files(then: Sequence[Sequence[Any]], now: Sequence[Sequence[Any]]) -> list[str]:
    """How the data files differ between two :attr:`TokenData.sources` lists, one phrase a
    file: added, gone, or its size or modification time changed."""
    before = {str(p): (int(size), int(mtime)) for p, size, mtime in then}
    after = {str(p): (int(size), int(mtime)) for p, size, mtime in now}
    told = []
    for path in dict.fromkeys([*before, *after]):
        if path not in after:
            told.append(f"{path} is gone")
        elif path not in before:
            told.append(f"{path} was added")
        elif before[path] != after[path]:
            (size0, _), (size1, mtime1) = before[path], after[path]
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime1 / 1e9))
            what = (
                f"{size0:,} -> {size1:,} bytes" if size0 != size1 else f"same size, modified {when}"
            )
            told.append(f"{path} changed ({what})")
    return told


class TokenData:
    """Documents tokenized once into a memory-mapped token file, packed into windows of
    ``seq`` tokens.  Made by :meth:`build`; see the module docstring for the rules."""

    def __init__(
        self,
        *,
        tokens: Tensor,
        seq: int,
        vocab: int,
        documents: int,
        files: int,
        path: Path,
        cached: bool,
        eval_fraction: float,
        tokenizer: _Tokenizer | None,
    ) -> None:
        self.tokens = tokens
        self.seq = seq
        self.vocab = vocab
        self.documents = documents
        self.files = files
        self.path = path
        self.cached = cached
        self.tokenizer = tokenizer
        self.sources: list[list[Any]] = []  # (path, size, mtime_ns) of each file read
        self.sha256 = ""  # of the token file: the data as tokenized
        n = int(tokens.numel())
        self.windows = max(0, (n - 1) // seq)
        self.val_windows = max(1, round(eval_fraction * self.windows))
        self.train_windows = self.windows - self.val_windows
        if self.windows < 2 or self.train_windows < 1:
            raise ZeropipeError(
                f"the data make {_plural(self.windows, 'window')} of {seq} tokens ({n:,} tokens "
                f"from {_plural(documents, 'document')}), of which {self.val_windows} would be "
                f"held out; "
                f"at least one to train on and one held out are needed: give more data or "
                f"a shorter --seq"
            )
        # The permutation of the epoch last read: a batch almost always stays in one epoch.
        self._epoch: tuple[int, int, Tensor] | None = None

    @classmethod
    def build(
        cls,
        paths: Sequence[str | PathLike[str]],
        *,
        tokenizer: _Tokenizer | None,
        seq: int,
        cache_dir: str | PathLike[str],
        text_field: str = "text",
        eval_fraction: float = 0.1,
        progress: Callable[[str], None] | None = print,
    ) -> TokenData:
        """The documents of ``paths`` (files or folders) tokenized by ``tokenizer`` (None:
        their UTF-8 bytes), read from ``cache_dir`` when an earlier build made them."""
        if seq < 1:
            raise ZeropipeError(f"a window of {seq} tokens: give --seq of at least 1")
        if not 0.0 <= eval_fraction < 1.0:
            raise ZeropipeError(
                f"eval_fraction {eval_fraction} is outside [0, 1): give the fraction of "
                f"windows to hold out, e.g. 0.1"
            )
        data_files, iter_documents = _readers()
        files = data_files(paths)
        sources = _sources(files)
        digest = "bytes" if tokenizer is None else tokenizer.digest()
        vocab = 256 if tokenizer is None else int(tokenizer.vocab)
        dtype_name = _dtype_name(vocab)
        cache = Path(cache_dir)
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ZeropipeError(
                f"cannot make the token cache {cache}: {exc.strerror or exc}; give a "
                f"writable --data-cache"
            ) from None
        key = _key(sources, digest, text_field)
        tokens_path, meta_path = cache / f"{key}.tokens", cache / f"{key}.json"
        # One process tokenizes; the others (torchrun's ranks, started together) wait for
        # it and read its cache.
        with _exclusive(cache / f"{key}.lock"):
            meta = _load_meta(meta_path, tokens_path, dtype_name, progress)
            cached = meta is not None
            if meta is None:
                meta = _tokenize(
                    files, iter_documents, text_field, tokenizer, dtype_name, tokens_path, progress
                )
                if _sources(files) != sources:
                    # The tokens may mix old and new text; the key names only one of them.
                    tokens_path.unlink(missing_ok=True)
                    raise ZeropipeError(
                        "a data file changed while it was being tokenized: run again once the "
                        "data stop changing"
                    )
                meta.update(vocab=vocab, sources=sources, tokenizer=digest, text_field=text_field)
                _write_json(meta_path, meta)
        n = int(meta["n_tokens"])
        tokens = torch.from_file(
            str(tokens_path), shared=False, size=n, dtype=_DTYPES[dtype_name][0]
        )
        made = cls(
            tokens=tokens,
            seq=seq,
            vocab=vocab,
            documents=int(meta["documents"]),
            files=len(files),
            path=tokens_path,
            cached=cached,
            eval_fraction=eval_fraction,
            tokenizer=tokenizer,
        )
        made.sources, made.sha256 = sources, str(meta["sha256"])
        return made

    def record(self) -> dict[str, Any]:
        """What a checkpoint keeps of its data, to refuse a resume on other data at the same
        paths: each file's path, size and mtime, the token count and the tokens' sha256."""
        return {"sources": self.sources, "tokens": int(self.tokens.numel()), "sha256": self.sha256}

    @property
    def eos(self) -> int | None:
        """The end-of-text id after every document (None: bytes, separated by a blank line)."""
        return None if self.tokenizer is None else self.tokenizer.eos_id

    def batch(
        self, step: int, batch_size: int, seq: int, seed: int = 0, split: str = "train"
    ) -> tuple[Tensor, Tensor]:
        """int64 inputs ``[batch_size, seq]`` and next-token targets for ``step``, fixed by
        (seed, step, split)."""
        if seq != self.seq:
            raise ZeropipeError(
                f"a batch of windows of {seq} tokens was asked of data packed into windows of "
                f"{self.seq} at build time: build again with seq={seq} (the tokens are cached)"
            )
        if batch_size < 1 or step < 0:
            raise ZeropipeError(
                f"batch of step {step} with batch size {batch_size}: give a step >= 0 and a "
                f"batch size >= 1"
            )
        first = step * batch_size
        if split == "train":
            windows = [self._train_window(first + j, seed) for j in range(batch_size)]
        elif split == "val":
            base = self.train_windows
            windows = [base + (first + j) % self.val_windows for j in range(batch_size)]
        else:
            raise ZeropipeError(f"split {split!r}: give 'train' or 'val'")
        rows = torch.stack(
            [self.tokens[w * seq : w * seq + seq + 1].to(torch.int64) for w in windows]
        )
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def _train_window(self, sample: int, seed: int) -> int:
        epoch, position = divmod(sample, self.train_windows)
        if self._epoch is None or self._epoch[:2] != (seed, epoch):
            # Any (seed, epoch) maps to a distinct 63-bit seed; manual_seed takes no more.
            g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (1 << 63))
            self._epoch = (seed, epoch, torch.randperm(self.train_windows, generator=g))
        return int(self._epoch[2][position])

    def decode(self, ids: Tensor) -> str:
        """The text of ``ids``: the tokenizer's decoding, or the bytes as UTF-8."""
        values = [int(i) for i in ids.reshape(-1).tolist()]
        if self.tokenizer is None:
            return bytes(values).decode("utf-8", errors="replace")
        return self.tokenizer.decode(values)

    def describe(self) -> str:
        """One start-up line: what was read, where the tokens live, how they are split."""
        where = f"cached in {self.path.parent}"
        if not self.cached:
            where = f"tokenized now, {where}"
        return (
            f"data: {_plural(self.files, 'file')}, {_plural(self.documents, 'document')}, "
            f"{_count(self.tokens.numel())} tokens ({where}), "
            f"{self.train_windows:,} train / {self.val_windows:,} held-out windows of {self.seq}"
        )


def _load_meta(
    meta_path: Path, tokens_path: Path, dtype_name: str, say: Callable[[str], None] | None
) -> dict[str, Any] | None:
    """The json of a usable cached token file, or None (saying why when one was there)."""
    if not meta_path.exists():
        return None
    why = ""
    try:
        meta = json.loads(meta_path.read_text())
        expected = int(meta["n_tokens"]) * torch.empty(0, dtype=_DTYPES[dtype_name][0]).itemsize
        if meta.get("format") != _FORMAT or meta.get("dtype") != dtype_name:
            why = "was written in another format"
        elif meta.get("byteorder") != sys.byteorder:
            why = "was written on a machine of the other byte order"
        elif not tokens_path.exists():
            why = "has no token file"
        elif tokens_path.stat().st_size != expected:
            why = f"token file is {tokens_path.stat().st_size:,} bytes, not {expected:,}"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        why = f"could not be read ({exc})"
    if not why:
        return meta
    if say is not None:
        say(f"token cache {meta_path.with_suffix('')} {why}: tokenizing again")
    return None


def _tokenize(
    files: list[Path],
    iter_documents: Callable[..., Iterator[str]],
    text_field: str,
    tokenizer: _Tokenizer | None,
    dtype_name: str,
    tokens_path: Path,
    say: Callable[[str], None] | None,
) -> dict[str, Any]:
    """Write the token file (through a temporary file renamed into place); its json fields."""
    from zeropipe.apps.data.tokenizer import has_text, no_text_message

    progress = _Progress(say)
    docs = _Counted(iter_documents(files, text_field=text_field), has_text)
    fd, tmp = tempfile.mkstemp(dir=tokens_path.parent, prefix=tokens_path.stem, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as raw:
            out = _Hashed(raw)
            n_tokens, documents = _write_tokens(
                out, docs, tokenizer, _DTYPES[dtype_name][1], progress
            )
        if not docs.with_text:  # nothing to learn from, and no cache of it is kept
            raise ZeropipeError(no_text_message(files, text_field, docs.documents))
        os.replace(tmp, tokens_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    progress.done(tokens_path.parent)
    eos = None if tokenizer is None else tokenizer.eos_id
    return {
        "format": _FORMAT,
        "dtype": dtype_name,
        "byteorder": sys.byteorder,
        "n_tokens": n_tokens,
        "documents": documents,
        "eos": eos,
        "separator": list(_BYTES_SEPARATOR) if tokenizer is None else [eos],
        "sha256": out.sha256.hexdigest(),
    }


def _write_json(path: Path, meta: dict[str, Any]) -> None:
    # Renamed into place after the token file: a json present means its tokens are complete.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(meta, out, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def data_vocab(data: str | None, tokenizer: str | None, seed: int) -> int:
    """The vocabulary the training tokens need, without reading ``--data``: the tokenizer's,
    256 for documents' bytes, or the generated corpus's alphabet (quick to make)."""
    if data is None:
        from zeropipe.apps.data.corpus import Corpus

        return Corpus.generate(seed=seed).vocab
    if tokenizer is None:
        return 256
    from zeropipe.apps.data.tokenizer import TextTokenizer

    return TextTokenizer.load(tokenizer).vocab
