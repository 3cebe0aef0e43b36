"""A run folder is one run's own (zeropipe.apps.train.lock): two trainings started on it
0.3 s apart give one run and one refusal, a lock left by a dead process is taken over
with a line saying so, and the lock goes when the run ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeropipe.apps.train import lock as run_lock
from zeropipe.apps.train.lock import LOCK_FILE, claim_run_dir, lock_holder
from zeropipe.core.errors import ZeropipeError

ROOT = Path(__file__).resolve().parents[3]
FLAGS = ["--width", "32", "--blocks", "2", "--batch-size", "8", "--microbatches", "4"]


def _start(out: Path, seed: int) -> subprocess.Popen[str]:
    argv = [
        "train",
        *FLAGS,
        "--ranks",
        "1",
        "--schedule",
        "1f1b",
        "--steps",
        "4",
        "--seed",
        str(seed),
    ]
    argv += ["--quiet", "--out", str(out)]
    return subprocess.Popen(
        [sys.executable, "-m", "zeropipe", *argv],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_trainings_on_one_folder_give_one_run_and_one_refusal(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = _start(out, seed=1)
    # Once the first holds the folder, it is paused while the second tries: however loaded
    # the machine, the first cannot finish (and leave a finished run) before the second asks.
    deadline = time.monotonic() + 120
    while not (out / LOCK_FILE).exists():
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline, "the first training never took the folder"
        time.sleep(0.02)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        second = _start(out, seed=2)
        _, err = second.communicate(timeout=240)
        results = {2: (second.returncode, err)}
    finally:
        os.kill(first.pid, signal.SIGCONT)
    _, err = first.communicate(timeout=240)
    results[1] = (first.returncode, err)
    codes = sorted(code for code, _ in results.values())
    assert codes == [0, 2], results
    winner = next(seed for seed, (code, _) in results.items() if code == 0)
    refusal = next(err for code, err in results.values() if code == 2).strip().splitlines()
    assert len(refusal) == 1 and "is in use by another zeropipe train (process" in refusal[0]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [row["step"] for row in rows if "loss" in row]
    assert steps == [1, 2, 3, 4]  # every row once, none of the other run's
    manifests = list((out / "checkpoints").glob("step-*/manifest.json"))
    assert manifests
    for manifest in manifests:
        assert json.loads(manifest.read_text())["meta"]["config"]["seed"] == winner
    assert not (out / LOCK_FILE).exists()  # released and removed at the end


def test_a_held_lock_refuses_and_names_its_holder(tmp_path: Path) -> None:
    assert lock_holder(tmp_path) is None
    with claim_run_dir(tmp_path):
        holder = lock_holder(tmp_path)
        assert holder is not None and holder.startswith(f"process {os.getpid()} on ")
        with (
            pytest.raises(ZeropipeError, match=r"in use by another zeropipe train") as caught,
            claim_run_dir(tmp_path),
        ):
            pass
        assert "\n" not in str(caught.value)
    assert lock_holder(tmp_path) is None
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True, check=True)  # fmt: skip
    (tmp_path / LOCK_FILE).write_text(f"{dead.stdout.strip()} somehost 1700000000\n")
    assert lock_holder(tmp_path) is None  # nobody holds it: the file alone is no lock
    with claim_run_dir(tmp_path):
        err = capsys.readouterr().err
        assert f"was locked by process {dead.stdout.strip()} on somehost" in err
        assert "no longer running; taking it over" in err
        assert (tmp_path / LOCK_FILE).read_text().split()[0] == str(os.getpid())


def test_a_lock_file_replaced_between_open_and_lock_is_opened_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The holder that is ending removes the file after we opened it: our lock would
    # guard a removed file, so the claim opens the path again.
    real = run_lock._try_lock
    calls: list[int] = []

    def racing(fd: int) -> bool:
        if not calls:
            (tmp_path / LOCK_FILE).unlink()
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(run_lock, "_try_lock", racing)
    with claim_run_dir(tmp_path):
        assert len(calls) == 2
        assert lock_holder(tmp_path) is not None
