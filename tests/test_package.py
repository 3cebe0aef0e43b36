"""The package surface: __all__ resolves, and the schedule half needs no torch."""

from __future__ import annotations

import subprocess
import sys

import zeropipe


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
