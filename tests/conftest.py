"""Test-wide settings: one intra-op thread, so tests do not fight each other (or CI) for cores.

Tests marked ``gpu`` (tests/test_gpu.py) need a CUDA GPU and are skipped, with the
reason shown under ``pytest -rs``, where torch sees none.  ``--data``'s token cache goes to
a temporary folder, not the user's ``~/.cache``.
"""

from __future__ import annotations

import os

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
