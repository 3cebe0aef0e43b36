"""``zeropipe train`` stopped by a signal keeps the step it was in, on every rank.

Each test starts the real command (a launcher and two ranks) in a session of
its own and signals it as a terminal or a job scheduler would: Ctrl-C is
SIGINT to the whole foreground process group (``os.killpg``), a scheduler's
stop is SIGTERM to the launcher.  The run must finish the step, save a
verified checkpoint of it, and exit 128 + the signal: 130 for SIGINT, 143 for
SIGTERM.

A test run in the background by a non-interactive shell inherits SIGINT
ignored (POSIX), which the command would rightly keep ignoring; the child
therefore starts with SIGINT at its default, as a terminal's foreground job has.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zeropipe.apps.train import state
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import train

ROOT = Path(__file__).resolve().parents[3]
# Small and slow enough that the run is still training when the signal comes.
FLAGS = ["--width", "32", "--blocks", "2", "--batch-size", "8", "--microbatches", "4"]
SMALL: dict[str, Any] = {
    "width": 32,
    "blocks": 2,
    "batch_size": 8,
    "microbatches": 4,
    "quiet": True,
}


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(out: Path, *flags: str) -> subprocess.Popen[str]:
    argv = ["train", *FLAGS, "--steps", "100000", "--checkpoint-every", "100000", "--quiet"]
    return subprocess.Popen(
        [sys.executable, "-m", "zeropipe", *argv, "--out", str(out), *flags],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job has
        preexec_fn=_default_sigint,
    )


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    # The last line may be half-written while it trains.
    return [json.loads(line)["step"] for line in path.read_text().splitlines()[:-1]]


def _signal_after_steps(
    proc: subprocess.Popen[str], out: Path, send: int, group: bool, times: int = 1
) -> tuple[str, str]:
    try:
        deadline = time.monotonic() + 150
        while len(_steps(out)) < 3:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the run never trained 3 steps"
            time.sleep(0.05)
        for _ in range(times):  # back to back, as a wrapper relaying it to the group does
            if group:
                os.killpg(proc.pid, send)
            else:
                os.kill(proc.pid, send)
        return proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _saved_step(out: Path, stdout: str, signame: str) -> int:
    found = re.search(rf"stopped by {signame} after step (\d+) of 100000: saved (\S+);", stdout)
    assert found, stdout
    step = int(found[1])
    root = out / "checkpoints"
    assert found[2] == str(state.step_dir(root, step))
    # Every completed step is in the checkpoint, and nothing was trained past it.
    assert (
        _steps(out)[-1] <= step
        and json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == step
    )
    manifest = state.verify(root)  # every file's sha256 checked
    assert manifest is not None and manifest.step == step
    return step


def test_ctrl_c_saves_the_last_step_on_every_rank_and_resume_goes_on(tmp_path: Path) -> None:
    proc = _start(tmp_path)
    stdout, stderr = _signal_after_steps(proc, tmp_path, signal.SIGINT, group=True)
    assert proc.returncode == 130, (proc.returncode, stdout, stderr)
    step = _saved_step(tmp_path, stdout, "SIGINT")
    assert "Traceback" not in stderr, stderr
    # The checkpoint loads, here on one rank: the run goes on from it.
    summary = train(TrainConfig(**SMALL, ranks=1, steps=step + 2, out=str(tmp_path), resume=True))
    assert summary["steps_run"] == 2 and summary["last_step"] == step + 2
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The start's eval (0), the steps, and the resumed run's start eval at the step it went
    # on from: the stopped run had no end eval.
    assert [r["step"] for r in rows] == [0, *range(1, step + 1), step, step + 1, step + 2]
    assert "eval_loss" not in rows[step] and "eval_loss" in rows[step + 1]


def test_sigterm_to_the_launcher_alone_stops_the_replicas_saved_with_143(
    tmp_path: Path,
) -> None:
    proc = _start(tmp_path, "--ranks", "1", "--dp", "2")
    stdout, stderr = _signal_after_steps(proc, tmp_path, signal.SIGTERM, group=False)
    assert proc.returncode == 143, (proc.returncode, stdout, stderr)
    _saved_step(tmp_path, stdout, "SIGTERM")
    assert "Traceback" not in stderr, stderr


def test_a_signal_relayed_twice_at_once_is_one_stop_and_saves(tmp_path: Path) -> None:
    """`timeout` or a shell relays a SIGTERM to the whole group: every process gets it twice
    at once, which is one stop, not "send it again to end them at once"."""
    proc = _start(tmp_path, "--ranks", "2")
    stdout, stderr = _signal_after_steps(proc, tmp_path, signal.SIGTERM, group=True, times=2)
    assert proc.returncode == 143, (proc.returncode, stdout, stderr)
    _saved_step(tmp_path, stdout, "SIGTERM")


_LAUNCHER = (
    "import sys\n"
    "from tests.apps.train.slow_ranks import slow_to_stop\n"
    "from zeropipe.core.errors import PipelineError\n"
    "from zeropipe.runtime.launch import launch\n"
    "wait = {'stop_wait': float(sys.argv[2])} if sys.argv[2:] else {}\n"
    "try:\n"
    "    launch(slow_to_stop, 2, sys.argv[1], timeout=600, **wait)\n"
    "except KeyboardInterrupt:\n"
    "    sys.exit(130)\n"
    "except PipelineError as exc:\n"
    "    sys.exit(f'zeropipe: error: {exc}')\n"
)


def _start_launcher(folder: Path, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(folder), *argv],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] not in "ZX"


def _wait_for(files: list[Path], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not all(f.exists() for f in files):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"never saw {files}"
        time.sleep(0.05)


def test_a_second_ctrl_c_ends_ranks_still_saving_at_once(tmp_path: Path) -> None:
    proc = _start_launcher(tmp_path)
    pids: list[int] = []
    try:
        _wait_for([tmp_path / f"ready{r}" for r in range(2)], proc)
        os.killpg(proc.pid, signal.SIGINT)
        saving = [tmp_path / f"saving{r}" for r in range(2)]
        _wait_for(saving, proc)  # the first Ctrl-C: the launcher waits for them
        pids = [int(f.read_text()) for f in saving]
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        again = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - again
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, (proc.returncode, stderr)
    assert took < 10, took
    assert "SIGINT: waiting up to 60 s for the ranks to stop" in stderr, stderr
    assert not [pid for pid in pids if _alive(pid)]


def test_ranks_that_do_not_stop_in_time_are_killed_and_named(tmp_path: Path) -> None:
    proc = _start_launcher(tmp_path, "2")
    try:
        _wait_for([tmp_path / f"ready{r}" for r in range(2)], proc)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 1, (proc.returncode, stderr)
    assert (
        "zeropipe: error: rank(s) [0, 1] had not stopped 2 s after SIGINT and were killed; "
        "whatever they had not saved is lost"
    ) in stderr, stderr
    assert took < 15, took
