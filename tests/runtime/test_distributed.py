"""Distributed executor over gloo: the non-pipelined gradients on 2 and 4 ranks, for every generator.

One launch per world size runs every case inside the ranks (see dist_cases.py)
and is shared by the tests here and in test_failures.py; the reference
gradients are computed once here, in the test process.  Every launch is
bounded by its timeout, the torchrun test by the subprocess timeout.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.gradcheck import as_params, assert_same_gradients, batch_for, mlp, no_crash, reference
from tests.runtime import dist_cases, three_rank_cases
from zeropipe.core.errors import PipelineError
from zeropipe.core.schedules import GENERATORS

WORLDS = (2, 4)
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _reference(model_name: str, m: int, step: int) -> tuple[float, dict[str, Tensor]]:
    build, loss_fn = dist_cases.MODELS[model_name]
    model = build()
    x, y = batch_for(model, batch=2 * m + 1)
    loss, grads = reference(model, x, y, loss_fn, m, seed=3, step=step)
    return loss.item(), grads


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_generator_matches_the_reference_float64(world: int, name: str) -> None:
    results = dist_cases.main_results(world)
    cases = [c for c in dist_cases.grid(world) if c[0] == name]
    assert len(cases) >= 2, f"{name}: fewer than two (model, m) combinations on {world} ranks"
    for _, model_name, m in cases:
        key = f"{name}/{model_name}/m={m}"
        all_names = set(dict(dist_cases.MODELS[model_name][0]().named_parameters()))
        for rank, out in enumerate(results):
            no_crash(out["grads"][key], f"{key} on rank {rank}")
        steps = dist_cases.steps_for(world, m)
        assert all(len(out["grads"][key]["steps"]) == steps for out in results), key
        for step in range(steps):
            ref_loss, ref = _reference(model_name, m, step)
            seen: set[str] = set()
            losses = []
            for rank, out in enumerate(results):
                got = out["grads"][key]["steps"][step]
                losses.append(got["loss"])
                worst = assert_same_gradients(as_params(got["grads"]), ref, only_owned=True)
                assert worst <= 1e-10, (key, rank, step, worst)
                seen |= set(got["grads"])
            assert len(set(losses)) == 1, f"{key} step {step}: ranks returned {losses}"
            assert abs(losses[0] - ref_loss) <= 1e-10, (key, step, losses[0], ref_loss)
            assert seen == all_names, f"{key}: no rank has gradients for {all_names - seen}"


def test_three_ranks_share_the_loss_and_tied_gradients() -> None:
    results = three_rank_cases.results()
    m = 7
    build, loss_fn = dist_cases.MODELS["tokens-tied"]
    for dtype in (torch.float64, torch.float32):
        model = build().to(dtype)
        x, y = batch_for(model, batch=2 * m + 1)
        for step in range(2):
            ref_loss, ref = reference(model, x, y, loss_fn, m, seed=3, step=step)
            got = [out[str(dtype)][step] for out in results]
            assert {g["dtype"] for g in got} == {str(dtype)}  # every rank, in the model's dtype
            assert len({g["loss"] for g in got}) == 1, got
            assert got[0]["loss"] == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-10)
            seen: set[str] = set()
            for g in got:  # float64 to 1e-10, float32 allclose (the shared helper's rules)
                assert_same_gradients(as_params(g["grads"]), ref, only_owned=True)
                seen |= set(g["grads"])
            assert seen == set(dict(model.named_parameters()))


@pytest.mark.parametrize("world", WORLDS)
def test_weights_run_in_groups_give_the_reference_gradients(world: int) -> None:
    results = dist_cases.main_results(world)
    for rank, out in enumerate(results):
        no_crash(out["grouped"], f"grouped on rank {rank}")
    keys = sorted(results[0]["grouped"])
    assert len(keys) >= 4, keys
    m = 2 * world + 1
    for key in keys:
        assert sum(out["grouped"][key]["fused"] for out in results) > 0, f"{key}: nothing fused"
        for step in range(2):
            ref_loss, ref = _reference("tokens-tied", m, step)
            for rank, out in enumerate(results):
                no_crash(out["grouped"][key], f"{key} on rank {rank}")
                got = out["grouped"][key]["steps"][step]
                worst = assert_same_gradients(as_params(got["grads"]), ref, only_owned=True)
                assert worst <= 1e-10, (key, rank, step, worst)
                assert abs(got["loss"] - ref_loss) <= 1e-10, (key, step)


def test_same_seed_same_result_on_two_ranks_four_ranks_and_locally() -> None:
    runs: dict[str, dict[str, Any]] = {}
    for world in WORLDS:
        merged: dict[str, Tensor] = {}
        losses = set()
        for rank, out in enumerate(dist_cases.main_results(world)):
            no_crash(out["same_seed"], f"same-seed run on rank {rank} of {world}")
            losses.add(out["same_seed"]["loss"])
            merged.update(out["same_seed"]["grads"])
        assert len(losses) == 1, (world, losses)
        runs[f"{world} ranks"] = {"loss": losses.pop(), "grads": merged}
    for ranks in WORLDS:
        runs[f"local, {ranks} ranks"] = dist_cases.same_seed_local(ranks)
    base_name, base = "local, 2 ranks", runs["local, 2 ranks"]
    assert len(base["grads"]) == len(list(mlp().parameters()))
    for label, run in runs.items():
        assert abs(run["loss"] - base["loss"]) <= 1e-12, (label, run["loss"], base["loss"])
        assert set(run["grads"]) == set(base["grads"]), label
        for n, g in run["grads"].items():
            diff = (g - base["grads"][n]).abs().max().item()
            assert diff <= 1e-12, f"{label} vs {base_name}: {n} differs by {diff:.3g}"


@pytest.mark.parametrize("world", WORLDS)
def test_tuples_with_integer_tensors_cross_ranks(world: int) -> None:
    for rank, out in enumerate(dist_cases.main_results(world)):
        case = out["tuple"]
        no_crash(case, f"tuple case on rank {rank}")
        assert case["worst"] <= 1e-10, (rank, case["worst"])
        assert abs(case["loss"] - case["ref_loss"]) <= 1e-12, (rank, case)


@pytest.mark.parametrize("world", WORLDS)
def test_eval_step_and_a_changing_batch_size(world: int) -> None:
    for rank, out in enumerate(dist_cases.main_results(world)):
        case = out["eval_rebatch"]
        no_crash(case, f"eval/rebatch case on rank {rank}")
        if rank == world - 1:  # the output exists where the last stage runs
            assert case["eval_output"] is not None and case["eval_output"] <= 1e-12, case
        else:
            assert case["eval_output"] is None, (rank, case)
        assert abs(case["eval_loss"] - case["plain_loss"]) <= 1e-12, (rank, case)
        assert [b for b, _, _ in case["steps"]] == [8, 11, 8]
        for batch, loss_diff, worst in case["steps"]:
            assert loss_diff <= 1e-10 and worst <= 1e-10, (rank, batch, loss_diff, worst)


@pytest.mark.parametrize("world", WORLDS)
def test_transport_moves_ints_bools_tuples_and_relearns_after_reset(world: int) -> None:
    receiver = dist_cases.main_results(world)[1]["transport"]
    no_crash(receiver, "transport case on rank 1")
    # step 0 learns (header), step 1 reuses, step 2 follows a reset with 5 rows
    assert receiver["received_ok"] == [True, True, True]


@pytest.mark.parametrize("world", WORLDS)
def test_a_step_hands_each_wait_to_a_pool_thread_once(world: int) -> None:
    # A hand-over and back costs two thread wake-ups on the step's critical path: the
    # step's end awaits its sends and its barrier round together (one per round), and a
    # receive whose data has already landed needs none.
    rounds = (world - 1).bit_length()
    for rank, out in enumerate(dist_cases.main_results(world)):
        case = out["handovers"]
        no_crash(case, f"hand-overs on rank {rank}")
        assert case["receives"] > 0
        # A receive whose data has landed is waited on without a hand-over.
        assert case["handovers"] + case["landed"] == case["receives"] + rounds, (rank, case)


@pytest.mark.parametrize("world", WORLDS)
def test_a_receive_buffer_tells_when_its_data_landed(world: int) -> None:
    case = dist_cases.main_results(world)[1]["landing"]
    no_crash(case, "landing case on rank 1")
    ordinary, like_the_mark = case["seen"]
    assert ordinary == {"before": False, "landed": True, "equal": True}
    # Data that ends in the mark's bytes reads as not landed: waited on as any other.
    assert like_the_mark == {"before": False, "landed": False, "equal": True}
    assert case["small"] is None  # under 8 bytes: not marked, always handed over


@pytest.mark.parametrize("world", WORLDS)
def test_launcher_store_is_the_store_the_ranks_poll(world: int) -> None:
    assert [out["store"] for out in dist_cases.main_results(world)] == [True] * world


@pytest.mark.parametrize("world", WORLDS)
def test_tied_gradients_accumulate_over_steps_like_backward(world: int) -> None:
    for out in dist_cases.main_results(world):
        no_crash(out["shared_accumulation"], "shared accumulation case")
        assert out["shared_accumulation"]["diff"] <= 1e-10
    assert any(
        out["shared_accumulation"]["checked"] == ["1f1b", "zbv"]
        for out in dist_cases.main_results(world)
    )


@pytest.mark.parametrize("world", WORLDS)
def test_auto_profiles_on_every_rank_and_agrees_on_one_plan(world: int) -> None:
    results = dist_cases.main_results(world)
    for out in results:
        no_crash(out["auto_profiled"], "auto profiled case")
        assert out["auto_profiled"]["loss_diff"] <= 1e-10
        assert out["auto_profiled"]["grad_diff"] <= 1e-10
    assert len({out["auto_profiled"]["schedule"] for out in results}) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(*args: str) -> subprocess.CompletedProcess[str]:
    """``dist_cases`` (with ``args``) on two ranks under torchrun, bounded."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "--max-restarts",
        "0",
        "-m",
        "tests.runtime.dist_cases",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        return subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150, check=False
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish within 150 s:\n{exc.stdout!r}\n{exc.stderr!r}")


def test_torchrun_runs_a_pipeline_with_the_reference_gradients() -> None:
    done = _torchrun()
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    # Two processes share stdout, so lines may interleave: match numbers strictly.
    lines = re.findall(r"rank (\d)/2 ok worst=([-+.0-9e]+) loss=([-+.0-9e]+)", done.stdout)
    assert sorted(r for r, _, _ in lines) == ["0", "1"], log
    assert len({loss for _, _, loss in lines}) == 1, lines


def test_under_torchrun_a_raising_rank_is_the_root_cause_and_its_peer_exits_cleanly() -> None:
    done = _torchrun("raise")
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    # the survivor relays the cause's message ...
    relayed = (
        "[rank0]: zeropipe.core.errors.PipelineError: rank 1 failed: rank 1 failed in training step "
        "1 at action 1F0"
    )
    assert relayed in log, log
    # ... and ends without a C++ abort, after rank 1: torchrun names rank 1 the cause
    assert "terminate called" not in log and "SIGABRT" not in log, log
    root = log.split("Root Cause (first observed failure):", 1)[-1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s+exitcode\s*: 1 ", root), log
    exits = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s+exitcode\s*: (-?\d+)", log))
    # 1: it exited on its own; -15: torchrun ended it (SIGTERM) once rank 1 had failed
    assert exits.get("0") in ("1", "-15"), (exits, log)


def test_distributed_transport_needs_an_initialised_process_group() -> None:
    from zeropipe.core.passes.lower import lower
    from zeropipe.core.schedules import generate
    from zeropipe.runtime.transport.tagged import DistributedTransport

    with pytest.raises(PipelineError, match=r"torch\.distributed initialised"):
        DistributedTransport(lower(generate("1f1b", 2, 2)), 0)


def test_device_string_stays_in_compat() -> None:
    # House rule 5: device detection for launch / init_from_env lives in _compat.
    runtime = ROOT / "zeropipe" / "runtime"
    for path in sorted(runtime.glob("*.py")):
        assert "cuda" not in path.read_text().lower(), path.name
