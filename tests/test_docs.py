"""The README and docs run as written: their code blocks, commands and links.

What runs, each in a fresh process with one intra-op thread, in a temporary folder:

- the ```python blocks of README.md and of each docs/*.md (docs/guide.md is the API tour),
  per file in order as one script (a block may continue the one before), each block on its
  own line numbers so a traceback names the document's line; a block that calls
  ``zeropipe.launch`` runs as a script of its own, since the processes it spawns import their
  script again;
- README.md's command lines: those of its ```bash blocks, the first column of its command
  table and the command under its picture; the ``zeropipe`` lines of the docs' ```bash blocks.

The two install commands at the top of the README cannot install again here (.ci/run runs the
second for real): their text is checked, and the first one's final command is run shortened.
Commands that are not run are listed in ``NOT_RUN`` with the reason.  Every ``zeropipe ...``
and ``python benchmarks/....py`` command written anywhere in README.md and docs/, run or not
(benchmark commands take minutes), has its subcommand and ``--flags`` checked against what
the CLI and the scripts accept.  Relative links and their #anchors must resolve.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Callable
from functools import cache
from importlib import import_module
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 220
TIMEOUT = 180  # seconds per subprocess: generous, the whole file runs in well under a minute

INSTALL = [
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    "pip install -e '.[plot]' && zeropipe train",
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    "pip install -e '.[dev]' && python -m pytest -q -n 2",
]

#: README command lines that are not run, and why.
NOT_RUN = {
    INSTALL[0]: "creates a venv and installs; its final command runs below as SHORTENED says",
    INSTALL[1]: "creates a venv, installs and runs the whole suite: .ci/run runs it verbatim",
    "zeropipe bench": (
        "a measurement: minutes of two processes per model (docs/benchmarks.md has its output)"
    ),
}

#: Commands run with fewer steps than written, and why.
SHORTENED = {
    # The default 300 steps take about a minute; 2 steps run every part (spawn, schedule,
    # steps, checkpoint, pictures) in a few seconds.
    "zeropipe train": "zeropipe train --steps 2",
    # The walkthrough's runs: a third of their steps still train the base and let the
    # fine-tuning's eval loss fall (asserted), in a third of the time.
    "zeropipe train --model llama --tokenizer walk/tokenizer --data walk/corpus.txt --seq 64 "
    "--steps 60 --out walk/base-run": "zeropipe train --model llama --tokenizer walk/tokenizer "
    "--data walk/corpus.txt --seq 64 --steps 20 --out walk/base-run",
    "zeropipe train --model-path walk/base --data walk/docs.jsonl --seq 64 --steps 100 "
    "--eval-every 25 --out walk/tuned-run": "zeropipe train --model-path walk/base --data "
    "walk/docs.jsonl --seq 64 --steps 30 --eval-every 10 --out walk/tuned-run",
}


# -- reading the documents ---------------------------------------------------------------
def fenced(path: Path, lang: str) -> list[tuple[int, str]]:
    """The ```lang blocks of ``path``: (line number of the block's first line, text)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = re.match(r"\s*```(\S*)", lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        if opening.group(1) == lang:
            blocks.append((i + 2, textwrap.dedent("\n".join(lines[i + 1 : end]))))
        i = end + 1
    return blocks


def bash_lines(path: Path) -> list[str]:
    return [
        line.strip()
        for _, text in fenced(path, "bash")
        for line in text.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def table_commands(path: Path, heading: str) -> list[str]:
    """The code in the first column of the table under ``heading``."""
    text = path.read_text(encoding="utf-8").split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]
    return [m.group(1).replace("\\|", "|") for m in re.finditer(r"^\| `([^`]+)` \|", text, re.M)]


def prose(path: Path) -> str:
    """``path`` without its fenced blocks."""
    text = path.read_text(encoding="utf-8")
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.M | re.S)


def inline_code(path: Path) -> list[str]:
    """The inline code spans of ``path`` (one may wrap onto the next line), spaces collapsed."""
    spans = re.finditer(r"`([^`\n]+(?:\n[^`\n]+)?)`", prose(path))
    return [" ".join(m.group(1).split()) for m in spans]


def inline_commands(path: Path) -> list[str]:
    """Every inline code span that is a ``zeropipe`` or ``python benchmarks/`` command."""
    return [
        s for s in inline_code(path) if re.match(r"(zeropipe|python benchmarks/\S+\.py)( |$)", s)
    ]


def picture_commands(path: Path) -> list[str]:
    """The commands that made the README's pictures (an italic caption opening with one)."""
    text = path.read_text(encoding="utf-8")
    return re.findall(r"^\*`(zeropipe [^`]+)`", text, re.M)


# -- running -----------------------------------------------------------------------------
def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES}
    return {**env, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}


# A test run under torchrun must not hand its rank to the processes it starts.
_LAUNCHER_VARIABLES = {
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RUN_ID", "GROUP_RANK",
}  # fmt: skip


def run(argv: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        argv, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT
    )
    assert proc.returncode == 0, (
        f"{what} exited with {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


def run_command(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A ``zeropipe`` command line, run by this interpreter (``python -m zeropipe``), or a
    ``python examples/...`` one, run by this interpreter too."""
    words = shlex.split(command)
    if words[0] == "python" and words[1].startswith("examples/"):
        return run([sys.executable, *words[1:]], cwd, f"`{command}`")
    assert words[0] == "zeropipe", command
    return run([sys.executable, "-m", "zeropipe", *words[1:]], cwd, f"`{command}`")


def script(path: Path, blocks: list[tuple[int, str]]) -> str:
    """``blocks`` of ``path`` as one script, each on its own lines of ``path``.

    Everything else is blank, so a traceback's line numbers are the document's.
    """
    lines = [""] * len(path.read_text(encoding="utf-8").splitlines())
    for first, text in blocks:
        for k, line in enumerate(text.splitlines()):
            lines[first - 1 + k] = line
    return "\n".join(lines) + "\n"


def run_python(path: Path, blocks: list[tuple[int, str]], cwd: Path, name: str) -> str:
    file = cwd / f"{name}.py"
    file.write_text(script(path, blocks), encoding="utf-8")
    where = ", ".join(f"{path.name} line {first}" for first, _ in blocks)
    return run([sys.executable, str(file)], cwd, f"the Python of {where}").stdout


def python_scripts(path: Path) -> list[tuple[str, list[tuple[int, str]]]]:
    """(name, blocks) per script: the blocks in order, a launched one on its own."""
    blocks = fenced(path, "python")
    alone = [b for b in blocks if "zeropipe.launch(" in b[1]]
    together = [b for b in blocks if b not in alone]
    stem = path.stem.lower()
    scripts = [(f"{stem}", together)] if together else []
    return scripts + [(f"{stem}_line{first}", [(first, text)]) for first, text in alone]


def docs_folder(tmp: Path) -> Path:
    """A working folder where the docs' relative paths (examples/, docs/) resolve."""
    (tmp / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    (tmp / "docs").mkdir()  # pictures are written here, not into the checkout
    return tmp


# -- the README's shape ------------------------------------------------------------------
def test_readme_is_at_most_220_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_readme_opens_with_the_two_install_commands() -> None:
    text = README.read_text(encoding="utf-8")
    title, rest = text.split("\n", 1)
    assert title.startswith("# ")
    expected = "".join(f"\n```bash\n{line}\n```\n" for line in INSTALL)
    assert rest.startswith(expected), "the README must open with the two install commands"
    assert bash_lines(README)[:2] == INSTALL


# -- the README's commands ---------------------------------------------------------------
def readme_commands() -> list[str]:
    seen: list[str] = []
    for command in [
        *bash_lines(README),
        *table_commands(README, "## Command line"),
        *picture_commands(README),
    ]:
        if command not in seen:
            seen.append(command)
    return seen


def to_run() -> list[str]:
    """The README's commands this file runs, in order (export reads what train wrote)."""
    final = INSTALL[0].rsplit("&&", 1)[1].strip()  # `zeropipe train`
    commands = [final] + [c for c in readme_commands() if c not in NOT_RUN and c != final]
    return [SHORTENED.get(c, c) for c in commands]


def test_every_readme_command_is_run_or_listed_as_not_run() -> None:
    for command in readme_commands():
        assert command in NOT_RUN or command.startswith(("zeropipe ", "python examples/")), (
            f"{command!r}: run it here (a zeropipe command or an example) or add it to NOT_RUN "
            f"with a reason"
        )
    stale = [c for c in NOT_RUN if c not in readme_commands()]
    assert not stale, f"NOT_RUN lists commands the README no longer has: {stale}"
    final = INSTALL[0].rsplit("&&", 1)[1].strip()
    unknown = [c for c in SHORTENED if c not in readme_commands() and c != final]
    assert not unknown, f"SHORTENED names commands the README does not have: {unknown}"


@pytest.fixture(scope="module")
def readme_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return docs_folder(tmp_path_factory.mktemp("readme"))


@pytest.mark.parametrize("command", to_run(), ids=to_run())
def test_readme_command_runs(command: str, readme_folder: Path) -> None:
    # Parametrized in README order, in one folder: `zeropipe export` reads the checkpoints
    # that `zeropipe train` (the install command's last step) wrote there.
    done = run_command(command, readme_folder)
    if "--eval-every" in command:  # the fine-tuning walkthrough: its eval loss falls
        start, end = re.findall(r"eval loss \(start -> end\)\s+(\S+) -> (\S+)", done.stdout)[0]
        assert float(end) < float(start), done.stdout
    if command == "zeropipe train --steps 2":
        for name in ("metrics.jsonl", "checkpoints", "loss.png", "trace.json", "timeline.png"):
            assert (readme_folder / "zeropipe-out" / name).exists(), name


# -- Python blocks -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "name", "blocks"),
    [
        pytest.param(p, name, blocks, id=name)
        for p in (README, *DOCS)
        for name, blocks in python_scripts(p)
    ],
)
def test_python_blocks_run(
    path: Path, name: str, blocks: list[tuple[int, str]], tmp_path: Path
) -> None:
    run_python(path, blocks, docs_folder(tmp_path), name)


def test_the_readme_and_the_guide_have_python_to_run() -> None:
    assert fenced(README, "python") and fenced(GUIDE, "python")


# -- commands in the docs ----------------------------------------------------------------
def docs_bash_commands() -> list[tuple[str, str]]:
    return [(p.name, line) for p in DOCS for line in bash_lines(p) if line.startswith("zeropipe ")]


@pytest.mark.parametrize(("doc", "command"), docs_bash_commands())
def test_docs_bash_command_runs(doc: str, command: str, tmp_path: Path) -> None:
    run_command(command, docs_folder(tmp_path))


def every_written_command() -> list[tuple[str, str]]:
    found = []
    for path in (README, *DOCS):
        lines = [s for line in bash_lines(path) for s in line.split("&&")]
        for command in [*lines, *inline_commands(path), *picture_commands(path)]:
            command = " ".join(command.split())
            if re.match(r"(zeropipe|python benchmarks/\S+\.py)( |$)", command):
                found.append((path.name, command))
    return sorted(set(found))


@cache
def cli_help(subcommand: str) -> str:
    """``zeropipe SUBCOMMAND --help``, through the console script's own entry point."""
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    entry = re.search(r'^zeropipe = "([\w.]+):(\w+)"', pyproject, re.M)
    assert entry is not None, "pyproject.toml names no `zeropipe` console script"
    module, name = entry.groups()
    main: Callable[[list[str]], int] = getattr(import_module(module), name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main([subcommand, "--help"])
    assert code == 0, f"zeropipe {subcommand} --help exited with {code}: {out.getvalue()}"
    return out.getvalue()


def test_every_written_command_names_real_flags() -> None:
    problems = []
    for doc, command in every_written_command():
        words = command.replace("\\|", "|").split()
        flags = [w.split("=", 1)[0] for w in words if w.startswith("--")]
        if words[0] == "zeropipe":
            if len(words) == 1:
                continue
            sub = words[1]
            if sub.startswith("-"):
                continue
            try:
                accepted = cli_help(sub)
            except AssertionError as exc:
                problems.append(f"{doc}: `{command}`: {exc}")
                continue
        else:
            source = ROOT / words[1]
            if not source.exists():
                problems.append(f"{doc}: `{command}`: no {words[1]}")
                continue
            accepted = source.read_text(encoding="utf-8")
        for flag in flags:
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", accepted):
                taker = " ".join(words[:2]) if words[0] == "zeropipe" else words[1]
                problems.append(f"{doc}: `{command}`: {taker} does not take {flag}")
    assert not problems, "\n".join(problems)


# -- links ------------------------------------------------------------------------------
def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_and_anchors_resolve() -> None:
    problems = []
    for path in (README, *DOCS):
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            file, _, fragment = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                problems.append(f"{path.name}: ({target}): no {file}")
            elif fragment and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), re.M)
                if fragment not in {anchor(h) for h in headings}:
                    problems.append(f"{path.name}: ({target}): no such heading in {linked.name}")
    assert not problems, "\n".join(problems)


# -- names ------------------------------------------------------------------------------
def resolves(dotted: str) -> bool:
    """Whether ``zeropipe.a.b.c`` names a module, or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_named_modules_attributes_and_files_exist() -> None:
    # `zeropipe.x.y` in the text must import (or be an attribute), and a repository path
    # (`zeropipe/...`, `tests/...`, `examples/...`, `benchmarks/...`, `docs/...`) must exist.
    problems = []
    for path in (README, *DOCS):
        for span in inline_code(path):
            for dotted in re.findall(r"(?<![\w.])zeropipe(?:\.\w+)+", span):
                if not resolves(dotted):
                    problems.append(f"{path.name}: `{span}`: {dotted} does not resolve")
            paths = r"(?<![\w./-])((?:zeropipe|tests|examples|benchmarks|docs)/[\w./-]*\w)"
            for file in re.findall(paths, span):
                if not (ROOT / file).exists():
                    problems.append(f"{path.name}: `{span}`: no {file}")
    assert not problems, "\n".join(problems)
