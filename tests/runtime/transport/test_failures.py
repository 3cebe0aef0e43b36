"""A multi-process failure ends every rank with the failing rank's message, in bounded time.

The in-pipeline failures (bad boundary shapes, an exception in a stage) run
at the end of the shared healthy launch per world size (dist_cases.main_cases),
each ranks catching its PipelineError and returning the message; a killed
rank, a raising rank and a hung launch need launches of their own.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.runtime import dist_cases
from tests.runtime.transport import failure_cases
from zeropipe import build_schedule
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Action, Kind
from zeropipe.runtime import launch as launch_module
from zeropipe.runtime import rank_process
from zeropipe.runtime.launch import init_from_env, launch
from zeropipe.runtime.pipeline import Pipeline
from zeropipe.runtime.transport.endpoint import Pending, WaitPool

WORLDS = (2, 4)
ROOT = Path(__file__).resolve().parents[3]


def _case(world: int, name: str) -> list[Any]:
    outs = [out[name] for out in dist_cases.main_results(world)]
    for rank, out in enumerate(outs):
        if isinstance(out, dict) and "crashed" in out:
            pytest.fail(f"{name} crashed inside rank {rank}:\n{out['crashed']}")
    return outs


@pytest.mark.parametrize("world", WORLDS)
def test_schedule_that_does_not_fit_the_world_is_rejected_before_communicating(
    world: int,
) -> None:
    for rank, messages in enumerate(_case(world, "fit")):
        assert messages[0] == (
            f"schedule '1f1b' has {2 * world} rank(s) but the pipeline's process group has "
            f"{world}; launch {2 * world} processes or build the schedule for {world} ranks "
            f"(zeropipe.build_schedule(name, ranks={world}, microbatches=...))"
        ), rank
        assert (
            f"has {world + 1} rank(s) but the pipeline's process group has {world}" in messages[1]
        ), rank


@pytest.mark.parametrize("world", WORLDS)
def test_boundary_shape_change_fails_on_the_sender_and_every_peer(world: int) -> None:
    outs = _case(world, "mismatch")
    cause = (
        "stage 0 microbatch 0: boundary output mismatch: expected float32[2, 4], got float32[2, 5]"
    )
    assert outs[0]["error"].startswith(cause), outs[0]
    for rank in range(1, world):
        assert outs[rank]["error"].startswith(f"rank 0 failed: {cause}"), (rank, outs[rank])
        assert outs[rank]["seconds"] < dist_cases.TIMEOUT / 2, (rank, outs[rank])
        # the pipeline is spent: a further step says so instead of mixing up messages
        assert "failed earlier" in outs[rank]["after"] and "new Pipeline" in outs[rank]["after"]
    assert outs[0]["after"] is not None


@pytest.mark.parametrize("world", WORLDS)
def test_transport_checks_learnt_shapes_on_the_sender(world: int) -> None:
    outs = _case(world, "transport")
    cause = (
        "stage 0 microbatch 0: 0SEND_F0 to rank 1: boundary tensors changed: expected "
        "float32[5, 3], int64[5], bool[3], got float32[4, 3], int64[4], bool[3]"
    )
    assert outs[0]["error"].startswith(cause), outs[0]
    for rank in range(1, world):
        assert outs[rank]["error"].startswith(f"rank 0 failed: {cause}"), (rank, outs[rank])
        assert outs[rank]["seconds"] < dist_cases.TIMEOUT / 2, (rank, outs[rank])
    assert outs[0]["device_error"] == (
        "0SEND_F0: boundary tensors are on meta; the gloo transport carries CPU tensors only"
    )


@pytest.mark.parametrize("world", WORLDS)
def test_exception_in_a_stage_forward_fails_every_rank_with_its_message(world: int) -> None:
    outs = _case(world, "forward_error")
    own = outs[1]["error"]
    # the second call to step (the pipeline counts from 0) and the action's place in
    # rank 1's list, each named as what it is
    assert own is not None and re.fullmatch(
        r"rank 1 failed in training step 1 at action 1F0 \(position \d+ of its schedule\): "
        r"ValueError: boom from stage 1",
        own,
    ), own
    for rank, out in enumerate(outs):
        if rank != 1:
            assert out["error"] == f"rank 1 failed: {own}", (rank, out)
        # noticed through the store within a few polls, far inside the 30 s timeout
        assert out["seconds"] < dist_cases.TIMEOUT / 3, (rank, out)


def test_an_error_in_a_stage_names_the_training_step_and_the_action_position() -> None:
    trap = failure_cases.Trap("raise")
    pipe = Pipeline(
        [nn.Linear(4, 4), trap], build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=F.mse_loss
    )
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    pipe.step(x, y)
    trap.armed = True
    position = pipe.schedule.actions[1].index(Action(Kind.F, 1, 0))
    with pytest.raises(PipelineError) as err:
        pipe.step(x, y)
    assert str(err.value) == (
        f"rank 1 failed in training step 2 at action 1F0 (position {position} of its "
        f"schedule): ValueError: boom from stage 1"
    )
    with pytest.raises(PipelineError) as err:
        pipe.eval_step(x)
    assert str(err.value).startswith(
        "rank 1 failed in an evaluation step (after 2 training steps) at action 1F0 (position "
    ), err.value


@pytest.mark.parametrize("world", WORLDS)
def test_a_stalled_peer_times_a_wait_out_and_every_rank_hears_of_it(world: int) -> None:
    outs = _case(world, "stalled")
    limit = failure_cases.SHORT_TIMEOUT
    # Stage 1 (rank 1) sleeps past the 1 s timeout.  The ranks waiting on it (directly
    # or down the pipe) time out; ranks that time out together may each report their
    # own, the first one recorded is what every other rank relays.
    own = {
        r: o["error"]
        for r, o in enumerate(outs)
        if re.fullmatch(
            rf"rank {r} waited {limit:g} s for {r}RECV_[FB]\d from rank \d \(timeout\); .*",
            o["error"] or "",
        )
    }
    assert own and 1 not in own, outs  # the stalled rank itself never waited that long
    for r in own:
        assert limit <= outs[r]["seconds"] < limit + 5, outs[r]
    relays = {r: o["error"] for r, o in enumerate(outs) if r not in own}
    assert 1 in relays, outs
    causes = set()
    for message in relays.values():
        found = re.match(r"rank (\d) failed: ", message or "")
        assert found is not None, relays
        causes.add(int(found.group(1)))
    assert len(causes) == 1, relays
    cause = causes.pop()
    assert cause in own, (cause, outs)
    for rank, message in relays.items():
        assert message == f"rank {cause} failed: {own[cause]}", (rank, message)
        assert outs[rank]["seconds"] < failure_cases.STALL + 5, (rank, outs[rank])


@pytest.mark.parametrize("noticed_by", ["launcher", "gloo"])
def test_a_killed_rank_ends_the_others_with_a_clear_error(
    noticed_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if noticed_by == "gloo":
        # as under torchrun: no launcher tells the store, the dropped connection must do
        monkeypatch.setattr(launch_module, "_tell_store", lambda *args: None)
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        launch(failure_cases.killed_case, 2, timeout=90, grace=10)
    took = time.monotonic() - start
    msg = str(err.value)
    assert msg.startswith("rank 1 failed: rank 1 was killed by SIGKILL"), msg
    # rank 0 reported its own error (it was not just terminated by the launcher) ...
    survivor = msg.split("--- other ranks ---\n", 1)[1]
    assert survivor.startswith("  rank 0: "), msg
    if noticed_by == "gloo":
        assert re.match(
            r"  rank 0: rank 1 stopped responding \(killed\?\) while rank 0 waited for "
            r"0RECV_[FB]\d from rank 1 \[.*(Connection reset by peer|Connection closed by peer)",
            survivor,
        ), msg
    else:
        # whichever came first: the launcher's note in the store, or the dropped connection
        assert (
            "rank 1 was killed by SIGKILL (the launcher saw it die)" in survivor
            or "rank 1 stopped responding (killed?) while rank 0 waited for" in survivor
        ), msg
    assert "terminated" not in msg, msg
    # ... well before its own 30 s wait timeout
    assert took < 60, took


def test_launch_reports_the_raising_rank_tells_its_peers_and_ends_the_rest() -> None:
    start = time.monotonic()
    with pytest.raises(PipelineError) as err:
        launch(failure_cases.raise_on_rank1, 3, timeout=90, grace=3)
    msg = str(err.value)
    assert msg.startswith("rank 1 failed: ValueError: bad input on rank 1"), msg
    assert "--- rank 1 traceback ---" in msg and 'raise ValueError("bad input on rank 1")' in msg
    # rank 0 was inside a step over the subgroup: the launcher's note reached it
    assert "\n  rank 0: rank 1 failed: ValueError: bad input on rank 1\n" in msg, msg
    # rank 2 never talks to anyone: only the launcher can end it
    assert msg.endswith("rank(s) [2] had not finished 3 s after the failure and were terminated")
    assert time.monotonic() - start < 60


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped is not: orphans go to a pid 1 that may never reap)."""
    if Path("/proc/self/stat").exists():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_end_silently_when_their_launcher_is_killed(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from tests.runtime.transport import failure_cases\n"
        "from zeropipe.runtime.launch import launch\n"
        "launch(failure_cases.train_forever, 2, sys.argv[1], timeout=300)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 150
        files = [tmp_path / f"rank{r}.pid" for r in range(2)]
        while not all(f.exists() for f in files):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the ranks never finished a first step"
            time.sleep(0.2)
        pids = [int(f.read_text()) for f in files]
        assert all(_alive(pid) for pid in pids)  # training, in a loop that never ends
        launcher.kill()
        launcher.wait(30)
        killed = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() < killed + 20:
            time.sleep(0.05)
        took = time.monotonic() - killed
        # EOF once the ranks, which share the launcher's stderr, are gone too
        out, err = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, 9)
    assert not [pid for pid in pids if _alive(pid)], "ranks outlived their launcher by 20 s"
    assert took < 5, took
    # no C++ store warnings with stack traces, no Python tracebacks: nothing at all
    assert "TCPStore" not in err and "frame #" not in err and "Traceback" not in err, err
    assert out == "", out


def test_a_rank_ends_when_its_launchers_pipe_closes_where_the_kernel_cannot_watch() -> None:
    ctx = mp.get_context("spawn")
    watched, lifeline = ctx.Pipe(duplex=False)
    child = ctx.Process(target=rank_process.wait_for_eof, args=(watched,), daemon=True)
    child.start()
    watched.close()
    try:
        child.join(1.0)
        assert child.is_alive()  # the launcher's end is open: it waits
        lifeline.close()  # as the launcher's death would
        child.join(20)
        assert child.exitcode == 1, child.exitcode
    finally:
        if child.is_alive():
            child.kill()


def test_wait_pool_counts_the_waits_still_blocked() -> None:
    # what decides, at exit, whether a rank can finalize normally
    pool = WaitPool()
    release = threading.Event()
    pool.submit(release.wait)
    pool.submit(lambda: None)
    deadline = time.monotonic() + 10
    while pool.busy > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.busy == 1
    release.set()
    while pool.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.busy == 0
    pool.close()


class _Work:
    """A stand-in for a c10d work: ``wait()`` blocks until released, then returns or raises."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.release = threading.Event()
        self.error = error

    def wait(self) -> bool:
        self.release.wait(10)
        if self.error is not None:
            raise self.error
        return True


def test_pending_finishes_once_every_work_is_done_and_stays_finished() -> None:
    pool = WaitPool()
    first, second = _Work(), _Work(RuntimeError("peer gone"))
    pending = Pending([first, second], [("first", 1), ("second", 2)], pool)
    assert not pending.finished(0.02)
    assert not pending.finished(0)  # a zero slice looks without waiting
    first.release.set()
    time.sleep(0.05)
    assert not pending.finished(0.02)  # the second is still out
    assert pending.label() == ("second", 2)
    second.release.set()
    assert pending.finished(5)
    assert pending.finished(0) and pending.finished(0.01)  # and stays so
    assert isinstance(pending.error, RuntimeError)
    assert Pending([], [], pool).finished(0)  # nothing to wait for
    pool.close()


def _environment_and_sigint(rank: int, world: int, name: str) -> tuple[str | None, bool]:
    return os.environ.get(name), signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_ranks_see_the_launchers_environment_and_sigint_as_they_are_at_each_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The ranks are forked from a server started at the first launch: what they see of
    # the launcher must still be the launcher's now, not what it was then.
    name = "ZEROPIPE_TEST_LAUNCH_ENV"
    monkeypatch.delenv(name, raising=False)
    assert launch(_environment_and_sigint, 2, name) == [(None, False)] * 2
    monkeypatch.setenv(name, "set after the first launch")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ignored = launch(_environment_and_sigint, 2, name)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert ignored == [("set after the first launch", True)] * 2
    monkeypatch.delenv(name)
    assert launch(_environment_and_sigint, 1, name) == [(None, False)]


def test_launch_timeout_kills_everything_and_says_so() -> None:
    start = time.monotonic()
    with pytest.raises(PipelineError, match=r"launch timed out after 3 s; rank\(s\) \[0\]"):
        launch(failure_cases.sleep_forever, 1, timeout=3)
    assert time.monotonic() - start < 20


def test_launch_arguments_are_checked() -> None:
    with pytest.raises(PipelineError, match="nprocs must be >= 1"):
        launch(failure_cases.sleep_forever, 0)
    with pytest.raises(PipelineError, match="timeout must be positive"):
        launch(failure_cases.sleep_forever, 1, timeout=0)


def test_init_from_env_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(PipelineError) as err:
        init_from_env()
    assert "WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK" in str(err.value)
    assert "torchrun" in str(err.value)
    assert not dist.is_initialized()
