"""The scripts in examples/ run to completion and check what they claim.

Each runs in a fresh process with one intra-op thread, as tests/test_docs.py runs the docs'
code: on a shared machine a second thread only spins, waiting for a core.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(script: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.parametrize("script", ["manual_stages.py", "schedule_from_file.py", "moe_parallel.py"])
def test_example_runs(script: str) -> None:
    out = _run(script, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    if script == "moe_parallel.py":
        diff = float(out.stdout.split("plain model")[1].split()[0])
        assert diff <= 1e-10
    if script == "schedule_from_file.py":
        line = out.stdout.strip().splitlines()[-1].split()
        assert line[2] == line[6], out.stdout  # pipeline loss equals plain model loss
    if script == "manual_stages.py":
        losses = [float(l.split()[-1]) for l in out.stdout.splitlines() if l.startswith("step")]
        assert losses[-1] < 0.5 * losses[0], losses


def test_hf_llama_example_trains_over_two_processes() -> None:
    pytest.importorskip("transformers", reason="examples/hf_llama.py needs transformers")
    out = _run("hf_llama.py", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    first, last = (float(v) for v in out.stdout.strip().splitlines()[-1].split()[1::2])
    assert last < first - 1.0, out.stdout
