"""Test-wide settings: one intra-op thread, so tests do not fight each other (or CI) for cores.

Tests marked ``gpu`` (tests/test_gpu.py) need a CUDA GPU and are skipped, with the
reason shown under ``pytest -rs``, where torch sees none.  ``--data``'s token cache goes to
a temporary folder, not the user's ``~/.cache``.

With pytest-xdist's workers (``-n 2``, as the README's test command runs the suite) each
test file runs whole, in order, on one worker (module fixtures and the README's walkthrough,
whose commands read what the one before wrote, run once), and files that read the same
shared launch (a module of cases whose results a ``functools.cache`` keeps for the session,
such as tests/runtime/dist_cases.py) run on the same worker, so that launch runs once
(:func:`pytest_xdist_make_scheduler`).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason=f"needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__})"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["ZEROPIPE_CACHE"] = str(tmp_path_factory.mktemp("token-cache"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Tests sent to workers by file (``--dist load``, the default with ``-n``, included: the
    suite needs it), the files that read one shared launch as one unit of work."""
    if config.getvalue("dist") not in ("load", "loadfile"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    group = _groups()

    class SharedLaunches(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return group.get(file, file)

    return SharedLaunches(config, log)


def _groups() -> dict[str, str]:
    """Each test file (as a node id names it) -> the first of the files it shares a launch with."""
    parent: dict[Path, Path] = {}

    def root(key: Path) -> Path:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    files = sorted(_TESTS.rglob("test_*.py"))
    for path in files:
        for shared in _shared_launches(path):
            a, b = root(path), root(shared)
            parent[max(a, b)] = min(a, b)
    top = _TESTS.parent
    return {str(f.relative_to(top)): str(root(f).relative_to(top)) for f in files}


_TESTS = Path(__file__).parent


def _shared_launches(path: Path) -> set[Path]:
    """The test-helper modules the file at ``path`` imports (anywhere in it) that keep a
    launch's results for the session."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests"):
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("tests")]
        else:
            continue
        for name in names:
            file = _TESTS.parent.joinpath(*name.split(".")).with_suffix(".py")
            if file.is_file() and file != path:
                text = file.read_text(encoding="utf-8")
                if "functools.cache" in text and "launch(" in text:
                    found.add(file)
    return found
