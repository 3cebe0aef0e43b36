"""Pipeline x tensor parallelism: stages made tensor-parallel by the user equal the plain model.

The ranks run in one launch of 4 processes on a ("pp", "tp") = (2, 2) gloo
mesh and one of 8 on ("pp", "dp", "tp") = (2, 2, 2) (tests/runtime/tp_cases.py).
Every rank must end each of two steps with the loss of the plain, unparallel
model and, gathered whole from its DTensor shards, the gradient of every
parameter its stages own (float64, 1e-10); the ranks of one tensor-parallel
group together own every parameter.
"""

from __future__ import annotations

import functools
import math
import re
import time
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.gradcheck import no_crash
from tests.runtime import tp_cases
from zeropipe.core.schedules import GENERATORS

TOL = 1e-10


@functools.cache
def _reference(rows: int, kind: str = "tp") -> tuple[float, dict[str, Tensor]]:
    model = tp_cases.plain_model(kind)
    x, y = tp_cases.batch(rows)
    loss = tp_cases.loss_fn(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(results: list[dict[str, Any]], key: str, rows: int = 2 * tp_cases.M) -> None:
    """Both steps of ``key``: every rank the plain loss; each pipeline of ranks, every gradient."""
    ref_loss, ref = _reference(rows, "chain" if key.startswith("chain/") else "tp")
    owned: dict[tuple[int, ...], set[str]] = {}
    for out in results:
        case = out["grads"][key]
        where = f"{key} on " + ", ".join(f"{d} {out[d]}" for d in ("pp", "dp", "tp") if d in out)
        no_crash(case, where)
        for step, got in enumerate(case["steps"]):
            assert abs(got["loss"] - ref_loss) <= TOL, (where, step, got["loss"], ref_loss)
            assert got["grads"], (where, step, "no gradient")
            for name, grad in got["grads"].items():
                worst = (grad - ref[name]).abs().max().item()
                assert worst <= TOL, (where, step, name, worst)
        # the pipeline ranks of one (dp, tp) coordinate own every parameter between them
        replica = tuple(out[d] for d in ("dp", "tp") if d in out)
        owned.setdefault(replica, set()).update(case["steps"][0]["grads"])
    for replica, names in owned.items():
        assert names == set(ref), f"{key}: {replica} has no gradient for {set(ref) - names}"


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_generator_on_pp2_tp2_matches_the_plain_model_float64(name: str) -> None:
    results = tp_cases.results()
    _check(results, f"tp/{name}/plain")
    if name in ("zb-h1", "zbv", "interleaved-zb"):  # the split backward: I and W on TP linears
        assert {"I", "W"} <= set(results[0]["grads"][f"tp/{name}/plain"]["kinds"])


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_sequence_parallel_stages_send_their_shard_and_match_the_plain_model(name: str) -> None:
    _check(tp_cases.results(), f"sp/{name}/plain")


@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved-zb"])
def test_a_row_wise_output_feeding_the_next_block_directly_is_exact(name: str) -> None:
    _check(tp_cases.results(), f"chain/{name}/plain")


@pytest.mark.parametrize("kind", ["tp", "sp"])
@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved-zb"])
def test_recompute_replays_the_tensor_parallel_collectives_exactly(kind: str, name: str) -> None:
    results = tp_cases.results()
    _check(results, f"{kind}/{name}/recompute")
    assert "R" in results[0]["grads"][f"{kind}/{name}/recompute"]["kinds"]


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_activation_offload_of_tensor_parallel_stages_is_exact(name: str) -> None:
    results = tp_cases.results()
    _check(results, f"tp/{name}/offload")
    for out in results:
        case = out["grads"][f"tp/{name}/offload"]
        assert {"OFFLOAD", "RELOAD"} <= set(case["kinds"])
        # saved DTensors went through the offload's handles as their local shard (what
        # OFFLOAD moves) and came back as DTensors
        assert case["dtensors_moved"] > 0, out


def test_weight_gradients_without_kept_memory_are_exact() -> None:
    _check(tp_cases.results(), "tp/zbv/no-grad-memory")


def test_the_ordered_transport_carries_tensor_parallel_stages_exactly() -> None:
    _check(tp_cases.results(), "tp/zbv/ordered")


@pytest.mark.parametrize("p2p", ["tagged", "ordered"])
def test_a_failing_tensor_parallel_rank_ends_every_rank_naming_it(p2p: str) -> None:
    """Global rank 1 (pipeline rank 0, TP rank 1) raises between TP collectives: its TP peer,
    inside one, and both ranks of the other pipeline all end, naming the injected failure."""
    from zeropipe.core.errors import PipelineError
    from zeropipe.runtime.launch import launch

    start = time.perf_counter()
    with pytest.raises(PipelineError) as info:
        launch(tp_cases.failing, tp_cases.WORLD, p2p, timeout=tp_cases.LAUNCH_TIMEOUT)
    took = time.perf_counter() - start
    text = str(info.value)
    assert text.startswith(f"rank {tp_cases.FAILING} failed:"), text[:300]
    others = dict(re.findall(r"^  rank (\d+): (.*)$", text, flags=re.MULTILINE))
    assert set(others) == {"0", "2", "3"}, text
    for rank, line in others.items():
        assert "injected failure on a tensor-parallel rank" in line, (rank, line)
        assert f"rank 0 (process {tp_cases.FAILING}) failed in training step 0" in line, line
    # the tensor-parallel peer lost its collective, and names who failed, not itself
    assert others["0"].startswith(f"process {tp_cases.FAILING} failed:"), others["0"]
    # spawning 4 processes takes seconds; hanging would take the launch's whole timeout
    assert took < tp_cases.LAUNCH_TIMEOUT / 2, took


def test_clip_grad_norm_counts_each_sharded_parameter_whole() -> None:
    results = tp_cases.results()
    model = tp_cases.plain_model()
    x, y = tp_cases.batch()
    for norm_type in (2.0, math.inf):
        model.zero_grad()
        tp_cases.loss_fn(model(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type)
        ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for out in results:
            no_crash(out["clip"], f"clip on pp {out['pp']}, tp {out['tp']}")
            got = out["clip"][str(norm_type)]
            assert got["norm"] == pytest.approx(norm.item(), rel=1e-12, abs=0), norm_type
            for name, grad in got["grads"].items():
                assert (grad - ref[name]).abs().max().item() <= TOL, (norm_type, name)


def test_auto_plan_profiled_on_every_process_gives_every_tp_peer_one_plan() -> None:
    _check(tp_cases.results(), "tp/auto/profiled")


def test_weight_offload_dtensor_boundaries_and_peers_out_of_step_are_refused() -> None:
    for out in tp_cases.results():
        no_crash(out["refusals"], "refusals")
        refusals = out["refusals"]
        # TP peers on different schedules would pair up the wrong collectives, silently
        assert "must run the same schedule on the same cut" in refusals["different_schedules"]
        assert "'1f1b'" in refusals["different_schedules"]
        assert "'gpipe'" in refusals["different_schedules"]
        assert "DTensor parameter" in refusals["weight_offload"]
        assert "drop the weight OFFLOAD/RELOAD" in refusals["weight_offload"]
        assert "returned a DTensor" in refusals["dtensor_boundary"]
        assert "use_local_output=True" in refusals["dtensor_boundary"]


@pytest.mark.parametrize("key", ["1f1b/shard", "zbv/shard", "1f1b/replicas"])
def test_pp2_dp2_tp2_with_fsdp_or_replicas_matches_the_global_batch(key: str) -> None:
    results = tp_cases.results_3d()
    _check(results, key, rows=2 * tp_cases.M * tp_cases.DP)
    case = results[0]["grads"][key]
    if key.endswith("shard"):  # FSDP2 over "dp" on top of TP over "tp": 2-D shards
        assert "(Shard(dim=0), Shard(dim=1))" in case["placements"], case["placements"]
    model = tp_cases.plain_model()
    x, y = tp_cases.batch(2 * tp_cases.M * tp_cases.DP)
    tp_cases.loss_fn(model(x), y).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    for out in results:
        assert out["grads"][key]["clip"] == pytest.approx(norm.item(), rel=1e-12), out


@pytest.mark.parametrize("key", [f"{n}/ranks={r}" for n, r in tp_cases.PP1_GRID])
def test_pp1_dp2_tp2_with_fsdp_matches_the_global_batch(key: str) -> None:
    """A "pp" dimension of one process: the pipeline runs in each process, sharded over "dp"."""
    results = [{**out["pp1"], "pp": 0} for out in tp_cases.results()]
    assert sorted((o["dp"], o["tp"]) for o in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    _check(results, key, rows=2 * tp_cases.M * tp_cases.DP)
    placements = results[0]["grads"][key]["placements"]
    assert "(Shard(dim=0), Shard(dim=1))" in placements, placements  # FSDP2 over TP: 2-D
