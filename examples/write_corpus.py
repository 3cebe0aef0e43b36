"""Write a text file and a .jsonl of documents to train a tokenizer and a model on.

They stand in for your own data (nothing is downloaded): the small synthetic language of
``zeropipe train``'s built-in corpus, ``corpus.txt`` as one text and ``docs.jsonl`` as
documents of a few sentences each, one JSON object with a "text" field per line.

    python examples/write_corpus.py walk
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from zeropipe.apps.data.corpus import Corpus


def text(chars: int, seed: int) -> str:
    corpus = Corpus.generate(chars=chars, seed=seed)
    return corpus.decode(corpus.tokens)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.txt").write_text(text(200_000, seed=0), encoding="utf-8")
    sentences = [s.strip() + "." for s in text(300_000, seed=1).split(". ")[:-1]]
    with open(out / "docs.jsonl", "w", encoding="utf-8") as fh:
        for start in range(0, len(sentences) - 4, 4):  # four sentences a document
            fh.write(json.dumps({"text": " ".join(sentences[start : start + 4])}) + "\n")
    print(f"wrote {out / 'corpus.txt'} and {out / 'docs.jsonl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "walk"))
