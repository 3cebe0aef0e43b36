"""Pipeline x data parallel: 2 pipeline ranks x 2 replicas equal the plain model on the global batch.

The ranks run in one launch of 4 processes (tests/runtime/dp_cases.py); each
replica steps on its own slice of the global batch, and every rank of every
replica must end with the loss and gradients of the plain model run on the
whole global batch (float64, 1e-10).
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.gradcheck import (
    as_params,
    assert_same_gradients,
    mlp,
    no_crash,
    reference,
    token_loss,
    token_model,
)
from tests.runtime import dp_cases
from zeropipe import causal_lm_loss
from zeropipe.core.schedules import GENERATORS


@functools.cache
def _reference(model_name: str, m: int, step: int) -> tuple[float, dict[str, Tensor]]:
    build, loss_fn = dp_cases.MODELS[model_name]
    model = build()
    x, y = dp_cases.global_batch(model, m)
    loss, grads = reference(model, x, y, loss_fn, dp_cases.DP * m, seed=dp_cases.SEED, step=step)
    return loss.item(), grads


def _check_ranks(results: list[dict[str, Any]], key: str, got_of: Any, ref_loss: float,
                 ref: dict[str, Tensor], names: set[str]) -> None:  # fmt: skip
    """Every rank of every replica: the reference loss; together, every parameter's gradient."""
    seen: dict[int, set[str]] = {}
    for out in results:
        got = got_of(out)
        where = f"{key} on pp rank {out['pp']}, replica {out['dp']}"
        assert abs(got["loss"] - ref_loss) <= 1e-10, (where, got["loss"], ref_loss)
        worst = assert_same_gradients(as_params(got["grads"]), ref, only_owned=True)
        assert worst <= 1e-10, (where, worst)
        seen.setdefault(out["dp"], set()).update(got["grads"])
    for dp, names_seen in seen.items():
        assert names_seen == names, f"{key}: replica {dp} has no gradient for {names - names_seen}"


def _check_against(
    results: list[dict[str, Any]], key: str, model: torch.nn.Module, ref_loss: Tensor
) -> None:
    """Case ``key`` on every rank against ``model``'s ``ref_loss`` (not yet backpropagated):
    that loss, and together every parameter's gradient."""
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for out in results:
        no_crash(out[key], key)
    names = set(dict(model.named_parameters()))
    _check_ranks(results, key, lambda o: o[key], ref_loss.item(), ref, names)


def _check_steps(results: list[dict[str, Any]], field: str, key: str) -> None:
    """Both steps of case ``key`` under ``field``: every rank has the global batch's loss and,
    the ranks of each replica together, every gradient."""
    _, model_name, m_text = key.split("/")
    m = int(m_text.removeprefix("m="))
    names = set(dict(dp_cases.MODELS[model_name][0]().named_parameters()))
    for out in results:
        no_crash(out[field][key], f"{field} {key} on pp={out['pp']} dp={out['dp']}")
    for step in range(2):
        ref_loss, ref = _reference(model_name, m, step)
        _check_ranks(
            results, f"{field} {key} step {step}",
            lambda o, k=key, s=step: o[field][k]["steps"][s], ref_loss, ref, names,
        )  # fmt: skip


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_generator_on_2x2_matches_the_global_batch_float64(name: str) -> None:
    results = dp_cases.results()
    cases = [c for c in dp_cases.grid() if c[0] == name]
    assert len(cases) >= 2, f"{name}: fewer than two (model, m) combinations"
    for _, model_name, m in cases:
        key = f"{name}/{model_name}/m={m}"
        _check_steps(results, "grads", key)
        for out in results:
            # the schedule sums each of the rank's stages once, after its last backward
            stages = {int(a.split("R")[0]) for a in out["grads"][key]["reductions"]}
            assert len(out["grads"][key]["reductions"]) == len(stages) >= 1, key


def test_counted_tokens_differing_between_replicas_give_the_global_mean() -> None:
    results = dp_cases.results()
    model = token_model()
    x, y = dp_cases.global_batch(model, 3)
    y = dp_cases.counted_targets(y)
    # the replicas count different numbers of tokens: an average of their means would be wrong
    halves = [dp_cases.counted(dp_cases.replica_slice(y, d)).item() for d in range(dp_cases.DP)]
    assert halves[0] != halves[1]
    total, count = dp_cases.counted_loss(model(x), y)
    _check_against(results, "counted", model, total / count)


def test_replicas_with_microbatches_of_their_own_lengths_give_the_global_mean() -> None:
    # Each replica steps on 4 microbatches of lengths of its own: the step's loss is
    # every replica's token losses summed over every counted token of the global batch.
    results = dp_cases.results()
    model = token_model(layers=8)
    fn = causal_lm_loss
    replicas = [dp_cases.replica_microbatches(d) for d in range(dp_cases.DP)]
    pairs = [(x, t) for b in replicas for x, t in zip(b.inputs, b.targets or (), strict=True)]
    counts = [sum(fn.count(t) for t in b.targets or ()) for b in replicas]
    assert counts[0] != counts[1]
    ref_loss = torch.stack([fn.sum_and_count(model(x), t)[0] for x, t in pairs]).sum() / sum(counts)
    _check_against(results, "varlen", model, ref_loss)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_equals_torch_on_the_plain_model(norm_type: float) -> None:
    results = dp_cases.results()
    model = token_model()
    x, y = dp_cases.global_batch(model, 4)
    token_loss(model(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type)
    assert ref_norm.item() > 0.05  # the reference does clip
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for out in results:
        no_crash(out["clip"], "clip")
        got = out["clip"][str(norm_type)]
        assert abs(got["norm"] - ref_norm.item()) <= 1e-10 * ref_norm.item(), (got, ref_norm)
        assert_same_gradients(as_params(got["grads"]), ref, only_owned=True)


def test_steps_accumulated_without_zero_grad_add_up() -> None:
    results = dp_cases.results()
    model = token_model()
    x, y = dp_cases.global_batch(model, 2)
    token_loss(model(x), y).backward()
    ref = {n: 2 * p.grad for n, p in model.named_parameters() if p.grad is not None}
    for out in results:
        no_crash(out["accumulate"], "accumulate")
        assert_same_gradients(as_params(out["accumulate"]["grads"]), ref)


def test_replicas_running_whole_pipelines_locally_sum_to_the_global_batch() -> None:
    results = dp_cases.results()
    model = mlp()
    x, y = dp_cases.batch_for(model, batch=2 * 2 * dp_cases.WORLD)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for rank, out in enumerate(results):
        no_crash(out["local"], f"local on rank {rank}")
        assert out["local"]["dp_size"] == dp_cases.WORLD
        assert out["local"]["slice"] == (rank, dp_cases.WORLD)  # one slice per replica
        assert abs(out["local"]["loss"] - loss.item()) <= 1e-10
        assert_same_gradients(as_params(out["local"]["grads"]), ref)


def test_the_measured_timeline_shows_each_reduction_from_its_post_to_its_completion() -> None:
    """Whether rank 1's reduction overlaps rank 0's last backward depends on how the OS
    schedules 4 processes on the machine's cores: benchmarks/data_parallel.py measures it
    (``hidden``); here, what the timeline must hold whatever the timing."""
    results = dp_cases.results()
    for out in results:
        no_crash(out["timeline"], "timeline")
    for dp in range(dp_cases.DP):
        ranks = {o["pp"]: o["timeline"]["events"] for o in results if o["dp"] == dp}
        # 1f1b: one stage per rank, its reduction posted after its last backward
        (reduce1,) = [e for e in ranks[1] if e[1] == "reduce"]
        (reduce0,) = [e for e in ranks[0] if e[1] == "reduce"]
        assert reduce1[0] == "1REDUCE_GRAD" and reduce0[0] == "0REDUCE_GRAD"
        for pp, red in ((0, reduce0), (1, reduce1)):
            last_backward = max(e[3] for e in ranks[pp] if e[1] == "compute")
            assert red[2] >= last_backward, (pp, red, last_backward)
            # it spans the all-reduce, which ends only once the other replica's rank posted
            # its own: not before the later of the two posts
            peer = next(o for o in results if o["pp"] == pp and o["dp"] != dp)
            (peer_red,) = [e for e in peer["timeline"]["events"] if e[1] == "reduce"]
            assert red[3] >= peer_red[2], (red, peer_red)


def test_a_mesh_that_is_no_mesh_is_refused() -> None:
    for out in dp_cases.results():
        no_crash(out["refusals"], "refusals")
        a_name, not_mesh = out["refusals"]
        assert "mesh='global': pass a DeviceMesh, a ProcessGroup, 'local'" in a_name
        assert "mesh must be a DeviceMesh" in not_mesh and "got object" in not_mesh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_torchrun_launches_as_two_nodes_match_the_global_batch(tmp_path: Path) -> None:
    """The dp_cases script, unchanged, under two torchrun launches of 2 processes each that
    meet at one rendezvous endpoint (--nnodes 2 --node-rank 0/1), as on two machines."""
    port, out = _free_port(), tmp_path / "results.pkl"
    env = {**os.environ, "ZEROPIPE_DP_OUT": str(out), "OMP_NUM_THREADS": "1"}

    def node(rank: int) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(rank), "--nproc-per-node", "2", "--rdzv-backend", "static",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
               "-m", "tests.runtime.dp_cases"]  # fmt: skip
        return subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    nodes = [node(0), node(1)]
    logs = []
    for proc in nodes:
        try:
            logs.append(proc.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for p in nodes:
                p.kill()
            pytest.fail("the two torchrun launches did not finish within 240 s")
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)
    with out.open("rb") as fh:
        results = pickle.load(fh)
    assert sorted((r["pp"], r["dp"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    keys = sorted(results[0]["grads"])
    assert {k.split("/")[0] for k in keys} == set(GENERATORS)
    for key in keys:
        _check_steps(results, "grads", key)


@pytest.mark.parametrize("name", dp_cases.FSDP_SCHEDULES)
def test_dp_shard_on_2x2_matches_the_global_batch_float64(name: str) -> None:
    """dp_shard=True: the shards' gradients, gathered whole, are the global batch's on every rank."""
    results = dp_cases.results()
    cases = [c for c in dp_cases.fsdp_grid() if c[0] == name]
    want = set(dp_cases.MODELS) if name in dp_cases.BOTH_MODELS else {"tokens-tied"}
    assert {c[1] for c in cases} == want, f"{name}: a model is not covered"
    for _, model_name, m in cases:
        key = f"{name}/{model_name}/m={m}"
        for out in results:
            no_crash(out["fsdp"][key], f"dp_shard {key} on rank pp={out['pp']} dp={out['dp']}")
        for pp in range(dp_cases.PP):
            outs = [o["fsdp"][key] for o in results if o["pp"] == pp]
            # between steps each replica holds a part of the stages, the parts make the whole
            full = outs[0]["full_numel"]
            assert all(0 < o["local_numel"] < full for o in outs), (key, pp, outs)
            assert sum(o["local_numel"] for o in outs) == full, (key, pp)
            for o in outs:
                stages = sorted({int(a.split("R")[0]) for a in o["reductions"]})
                for step in o["steps"]:
                    # one reduce-scatter per unit, at a REDUCE_GRAD of this rank's stages
                    assert len(step["reduced"]) == len(set(step["reduced"])) == o["units"] >= 1
                    assert set(step["reduced"]) <= set(stages), (key, step["reduced"], stages)
        _check_steps(results, "fsdp", key)


def test_dp_shard_without_a_dp_group_or_with_weight_offload_is_refused() -> None:
    for out in dp_cases.results():
        no_crash(out["fsdp_refusals"], "fsdp_refusals")
        no_group, offload = out["fsdp_refusals"]
        assert (
            "RuntimeOptions(dp_shard=True) shards the stages over a data-parallel group" in no_group
        ), no_group
        assert "dp_shard=True with weight OFFLOAD/RELOAD" in offload, offload


def test_dp_shard_with_a_pp_dimension_of_one_process_matches_the_global_batch() -> None:
    """A mesh ("pp", "dp") = (1, 4): each process plays both pipeline ranks, sharded over "dp";
    the embedding tied to the head (stages of both ranks) is one FSDP unit, reduced once."""
    model = token_model()
    x, y = dp_cases.batch_for(model, batch=2 * 2 * dp_cases.WORLD)
    loss = token_loss(model(x), y)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for rank, out in enumerate(dp_cases.results()):
        no_crash(out["local_shard"], f"local_shard on rank {rank}")
        assert abs(out["local_shard"]["loss"] - loss.item()) <= 1e-10
        assert out["local_shard"]["units"] == 1  # the tie joins both stages
        worst = assert_same_gradients(as_params(out["local_shard"]["grads"]), ref)
        assert worst <= 1e-10, (rank, worst)


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_dp_shard_trains_like_the_plain_model(name: str) -> None:
    """SGD on the shards, then a step: the next all-gather sees the updated weights; a step
    without zero_grad adds its gradients; eval_step gives the loss and leaves the stages sharded."""
    model = token_model()
    x, y = dp_cases.global_batch(model, 4)
    opt = torch.optim.SGD(model.parameters(), lr=dp_cases.LR)
    token_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ref_loss = token_loss(model(x), y)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    names = set(ref)
    results = dp_cases.results()
    for out in results:
        no_crash(out["fsdp_train"][name], f"dp_shard training {name}")
        got = out["fsdp_train"][name]
        assert got["eval_loss"] is not None
        assert abs(got["eval_loss"] - ref_loss.item()) <= 1e-10, (got["eval_loss"], ref_loss)
        assert got["sharded_after_eval"]
        assert "dp_shard=True pipeline are not supported yet" in got["checkpoint"]
        twice = {k: g / 2 for k, g in got["twice"].items()}
        assert_same_gradients(as_params(twice), ref, only_owned=True)
    _check_ranks(
        results, f"dp_shard training {name}", lambda o: o["fsdp_train"][name], ref_loss.item(),
        ref, names,
    )  # fmt: skip
