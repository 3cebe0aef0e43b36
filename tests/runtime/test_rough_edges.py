"""Rough edges a new user met: each one now refused in one line naming the fix, or exact.

- a schedule name of several chunks per rank given one rank's stages (zbv on 2 stages);
- a plain ``loss_fn`` that returns a sum over its rows, taken for a mean (microbatches of
  one row included: each is probed with the next);
- Ctrl-C while ``zeropipe.launch`` starts its ranks (tracebacks instead of one line).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeropipe
from tests.gradcheck import assert_same_gradients, mlp, reference
from zeropipe import Pipeline, build_schedule
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.step.loss_contract import LossContract


def _linears(n: int) -> list[nn.Module]:
    return [nn.Linear(4, 4).double() for _ in range(n)]


@pytest.mark.parametrize(("name", "v"), [("zbv", 2), ("dualpipev", 2), ("interleaved-1f1b", 2)])
def test_a_v_schedule_name_on_one_ranks_stages_is_refused_naming_both_meanings(
    name: str, v: int
) -> None:
    with pytest.raises(PipelineError) as err:
        Pipeline(_linears(v), name, F.mse_loss, microbatches=4)
    message = str(err.value)
    assert "\n" not in message
    assert f"{name} holds {v} stages per rank" in message, message
    assert f"{v} stages make 1 rank" in message and f"split into {2 * v} stages" in message
    assert f"zeropipe.build_schedule({name!r}, ranks=1, microbatches=4)" in message, message
    assert ("(a V)" in message) == (name != "interleaved-1f1b")


def test_one_v_rank_said_with_a_built_schedule_and_two_ranks_from_four_stages_still_run() -> None:
    one = Pipeline(_linears(2), build_schedule("zbv", ranks=1, microbatches=4), F.mse_loss)
    assert one.schedule.num_ranks == 1 and one.schedule.num_stages == 2
    two = Pipeline(zeropipe.split(nn.Sequential(*_linears(4)), 4), "zbv", F.mse_loss,
                   microbatches=4)  # fmt: skip
    assert two.schedule.num_ranks == 2


# -- a plain loss_fn returning a sum over its rows -------------------------------------------
M = 4  # microbatches of 2 rows


def _batch(classes: bool = False) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2 * M, 8, generator=g, dtype=torch.float64)
    if classes:
        return x, torch.randint(0, 8, (2 * M,), generator=g)
    return x, torch.randn(2 * M, 8, generator=g, dtype=torch.float64)


def _pipe(loss_fn: Callable[[Tensor, Tensor], Tensor], model: nn.Sequential) -> Pipeline:
    return Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=M), loss_fn)


def _squares(out: Tensor, target: Tensor) -> Tensor:
    return ((out - target) ** 2).sum()


class _Counted:
    """A loss_fn that counts its calls."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, out: Tensor, target: Tensor) -> Tensor:
        self.calls += 1
        return self.fn(out, target)


@pytest.mark.parametrize(
    ("loss_fn", "name"),
    [(_squares, "_squares"), (lambda o, t: F.mse_loss(o, t, reduction="sum"), "<lambda>")],
    ids=["function", "lambda"],
)
def test_a_loss_fn_returning_a_sum_over_its_rows_is_refused_at_the_first_step(
    loss_fn: Callable[[Tensor, Tensor], Tensor], name: str
) -> None:
    model = mlp(layers=4)
    pipe = _pipe(loss_fn, model)
    with pytest.raises(PipelineError) as err:
        pipe.step(*_batch())
    message = str(err.value)
    assert "\n" not in message
    assert f"loss_fn {name} returns a sum over its microbatch's rows" in message, message
    assert "return the mean" in message and "reduction = 'sum'" in message, message
    assert "Pipeline(loss_count=...)" in message
    assert all(p.grad is None for p in model.parameters())  # the failed step left no gradient


class _SquaresModule(nn.Module):
    """The same sum, declared: a module whose reduction is "sum" is weighted 1 per microbatch."""

    reduction = "sum"

    def forward(self, out: Tensor, target: Tensor) -> Tensor:
        return _squares(out, target)


def test_a_sum_declared_by_a_module_with_reduction_sum_is_the_batchs_sum() -> None:
    model = mlp(layers=4)
    x, y = _batch()
    ref_loss, ref = reference(model, x, y, _squares, M)
    loss = _pipe(_SquaresModule(), model).step(x, y)
    assert abs(loss.item() - ref_loss.item()) <= 1e-10
    assert assert_same_gradients(model.named_parameters(), ref) <= 1e-10


@pytest.mark.parametrize("kind", ["mse", "cross_entropy"])
def test_mean_losses_pass_the_probe_once_and_stay_exact(kind: str) -> None:
    mean = F.mse_loss if kind == "mse" else (lambda o, t: F.cross_entropy(o, t))
    model = mlp(layers=4)
    x, y = _batch(classes=kind == "cross_entropy")
    ref_loss, ref = reference(model, x, y, mean, M)
    counted = _Counted(mean)
    pipe = _pipe(counted, model)
    assert pipe.loss is not None and pipe.loss.probes_left > 0
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        assert abs(loss.item() - ref_loss.item()) <= 1e-10, step
        assert assert_same_gradients(model.named_parameters(), ref) <= 1e-10
    # one call per microbatch and step, and the two halves of the first microbatch, once
    assert counted.calls == 2 * M + 2, counted.calls
    assert pipe.loss.probes_left == 0


def test_a_zero_loss_cannot_tell_sum_from_mean_and_passes_probed_a_few_times() -> None:
    counted = _Counted(lambda o, t: (o * 0).sum())
    pipe = _pipe(counted, mlp(layers=4))
    assert pipe.loss is not None
    probes = pipe.loss.probes_left
    for _ in range(2):
        assert pipe.step(*_batch()).item() == 0.0
    # each microbatch probed while the probes could not tell, up to their number
    assert pipe.loss.probes_left == max(probes - M, 0)
    assert counted.calls == 2 * M + 2 * min(probes, M), counted.calls


# Microbatches of one row: batch 4 in 4 microbatches, each probed with the next.
def _one_row_pipe(loss_fn: Callable[[Tensor, Tensor], Tensor], model: nn.Sequential) -> Pipeline:
    return Pipeline(model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn)


def test_a_sum_over_microbatches_of_one_row_is_refused_probed_on_two_together() -> None:
    model = mlp(layers=4)
    x, y = _batch()
    pipe = _one_row_pipe(lambda o, t: F.mse_loss(o, t, reduction="sum"), model)
    with pytest.raises(PipelineError) as err:
        pipe.step(x[:4], y[:4])  # was silently scaled by 1/4: 7.47 for the batch's 29.87
    message = str(err.value)
    assert "\n" not in message
    assert "loss_fn <lambda> returns a sum over its microbatch's rows" in message, message
    assert "two microbatches together is the sum of theirs alone" in message, message
    assert all(p.grad is None for p in model.parameters())


def test_a_mean_over_microbatches_of_one_row_passes_one_pair_probe_and_stays_exact() -> None:
    model = mlp(layers=4)
    x, y = _batch()
    x, y = x[:4], y[:4]
    ref_loss, ref = reference(model, x, y, F.mse_loss, 4)
    counted = _Counted(F.mse_loss)
    pipe = _one_row_pipe(counted, model)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        loss = pipe.step(x, y)
        assert abs(loss.item() - ref_loss.item()) <= 1e-10, step
        assert assert_same_gradients(model.named_parameters(), ref) <= 1e-10
    # one call per microbatch and step, and one on the first two microbatches together
    assert counted.calls == 2 * 4 + 1, counted.calls
    assert pipe.loss is not None and pipe.loss.probes_left == 0


def test_pair_probes_that_cannot_tell_are_bounded() -> None:
    counted = _Counted(lambda o, t: (o * 0).sum())
    pipe = _one_row_pipe(counted, mlp(layers=4))
    assert pipe.loss is not None
    probes = pipe.loss.probes_left
    x, y = _batch()
    for _ in range(3):
        assert pipe.step(x[:4], y[:4]).item() == 0.0
    # two pairs a step, one call each, until the probes run out
    assert pipe.loss.probes_left == 0
    assert counted.calls == 3 * 4 + probes, counted.calls


def test_a_one_row_microbatch_pairs_only_with_one_cut_alike() -> None:
    """Shapes beyond dim 0 that differ cannot be concatenated: no call, no probe used; a pair
    of tuple outputs is passed to loss_fn as a tuple, as the stage gives it."""
    calls: list[object] = []

    def summed(out: object, target: Tensor) -> Tensor:
        calls.append(out)
        parts = out if isinstance(out, tuple) else (out,)
        return sum(((o - target) ** 2).sum() for o in parts)  # type: ignore[return-value]

    contract = LossContract(summed)
    left = contract.probes_left
    one, two = torch.randn(1, 3), torch.randn(1, 4)
    value = torch.zeros(())
    assert not contract.probe_pair(summed, ((one,), one, value), ((two,), two, value))
    assert calls == [] and contract.probes_left == left
    a, b, t = torch.randn(1, 3), torch.randn(1, 3), torch.randn(1, 3)
    kept = ((a, b), t, summed((a, b), t))
    later = ((b, a), t, summed((b, a), t))
    with pytest.raises(PipelineError, match="two microbatches together"):
        contract.probe_pair(summed, kept, later)
    assert isinstance(calls[-1], tuple) and calls[-1][0].shape == (2, 3)


def test_the_probe_leaves_the_rng_state_and_the_graph_as_it_found_them() -> None:
    """A loss drawing random numbers (the probe cannot tell it: it passes): the RNG state after
    the probe is the one before, and the output's gradient is the whole loss's only."""

    def noisy(out: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(F.dropout(out, 0.5, training=True), target)

    contract = LossContract(noisy)
    x, y = _batch()
    out = x.clone().requires_grad_(True)
    whole = noisy(out, y)
    state = torch.random.get_rng_state()
    contract.probe_mean(noisy, out, y, whole)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert contract.probes_left == LossContract(noisy).probes_left - 1  # probed: no answer
    (alone,) = torch.autograd.grad(whole, out, retain_graph=True)
    whole.backward()
    assert out.grad is not None and torch.equal(out.grad, alone)


# -- Ctrl-C while zeropipe.launch starts its ranks -------------------------------------------
_LAUNCHER = """
import sys, time
import zeropipe

def work(rank, world):
    time.sleep(60)

if __name__ == "__main__":
    try:
        zeropipe.launch(work, 2, stop_wait=30)
    except KeyboardInterrupt:  # what a script does with the launch's KeyboardInterrupt
        sys.exit(130)
"""


def _starting(pid: int) -> int:
    """How many of ``pid``'s descendants are Python processes that multiprocessing started
    (spawned ranks, or the fork server and the ranks it forks)."""
    running, todo = 0, [pid]
    while todo:
        parent = todo.pop()
        try:
            with open(f"/proc/{parent}/task/{parent}/children") as fh:
                children = fh.read().split()
        except OSError:  # ended already
            continue
        for child in children:
            try:
                with open(f"/proc/{child}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except OSError:
                continue
            running += b"spawn_main" in cmdline or b"forkserver" in cmdline
            todo.append(int(child))
    return running


@pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
    reason="needs Linux /proc to see the ranks start",
)
def test_ctrl_c_while_the_ranks_start_ends_them_quietly_with_one_line(tmp_path: Path) -> None:
    """SIGINT to the process group (a terminal's Ctrl-C) as soon as both ranks exist, while
    they import torch: every process ends promptly, no traceback, zeropipe's one line."""
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        # and SIGINT at its default, as there (a background shell's test run ignores it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env=env,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        # The first of them (the fork server) imports torch, the ranks' start-up.
        while _starting(proc.pid) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.01)
        # Past the interpreter's own start (its SIGINT handler installed), inside the imports
        # of torch, which take seconds.
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=40)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeropipe: SIGINT: waiting up to"), err
    assert proc.returncode == 130, (proc.returncode, err)
    # the ranks' start-up (seconds, on a loaded machine), not the launcher's 30 s stop_wait
    assert took < 15, took
