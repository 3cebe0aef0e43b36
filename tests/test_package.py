"""The package surface: __all__ resolves, and the schedule half needs no torch; and the
suite's split over pytest-xdist's workers (tests/conftest.py), where a shared launch runs once."""

from __future__ import annotations

import subprocess
import sys

import zeropipe
from tests.conftest import _groups


def test_every_public_name_resolves() -> None:
    for name in zeropipe.__all__:
        assert getattr(zeropipe, name) is not None, name


def test_schedule_half_imports_without_torch() -> None:
    code = (
        "import sys, zeropipe, zeropipe.core.schedules, zeropipe.core.simulate, zeropipe.core.validate, zeropipe.core.passes.lower\n"
        "s = zeropipe.generate('zbv', 4, 8)\n"
        "t = zeropipe.simulate(s)\n"
        "assert t.makespan > 0\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_files_reading_one_shared_launch_share_a_worker_and_the_rest_go_alone() -> None:
    group = _groups()
    # Both read tests/runtime/dist_cases.py's launches.
    assert (
        group["tests/runtime/test_distributed.py"] == group["tests/runtime/step/test_batch_norm.py"]
    )
    # Both read tests/adapters/hf_two_processes.py's launch.
    assert group["tests/adapters/test_hf.py"] == group["tests/adapters/test_hf_mask.py"]
    # A file that reads no shared launch is a unit of its own.
    assert group["tests/core/test_ir.py"] == "tests/core/test_ir.py"
    assert group["tests/test_docs.py"] == "tests/test_docs.py"
