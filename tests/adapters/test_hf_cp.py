"""Context parallelism: split HF models whose sequences are sharded over "cp", exactly the
model's own loss and gradients.

The gradient checks are one 4-process gloo launch (tests/adapters/cp_cases.py: cp 2 inside
pp 2, Llama under every generator, Mistral, Qwen2 and Qwen3 under 1f1b, sdpa attention,
packed rows whose position ids restart; microbatches of different lengths under zbv;
pp 1 x dp 2 x cp 2, replicated and with
dp_shard=True; pp 2 x cp 2 with dp_shard=True) and one 8-process launch (cp 2 x tp 2
inside pp 2), compared here with the unsplit, unsharded model in float64.  Every cp rank
is given the whole batch and must report the whole batch's loss and, after the sum over
cp, the whole gradients.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch
from torch import Tensor

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

import zeropipe
from tests.adapters import cp_cases
from tests.gradcheck import no_crash
from zeropipe.adapters.context_parallel import shard_indices
from zeropipe.core.errors import PipelineError

TOL = 1e-12


@functools.cache
def _reference(arch: str, attn: str, kind: str) -> list[tuple[float, dict[str, Tensor]]]:
    return cp_cases.reference(arch, attn, kind)


def _check_steps(where: str, steps: Any, refs: list[tuple[float, dict[str, Tensor]]]) -> set[str]:
    seen: set[str] = set()
    for step, (ref_loss, ref_grads) in enumerate(refs):
        mine = steps[step]
        assert abs(mine["loss"] - ref_loss) <= TOL, (where, step, mine["loss"], ref_loss)
        for name, g in mine["grads"].items():
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff <= TOL, f"{where} step {step}: {name} differs by {diff:.3g}"
        seen |= set(mine["grads"])
    return seen


@pytest.mark.parametrize("key", sorted(cp_cases.CASES))
def test_context_parallel_pipeline_gives_the_models_own_loss_and_gradients(key: str) -> None:
    arch, name, attn, kind = cp_cases.CASES[key]
    results = cp_cases.results()
    got = [r["cases"][key] for r in results]
    if all(isinstance(g, str) and g.startswith("skipped") for g in got):
        pytest.skip(f"{name} does not run on {cp_cases.PP} ranks x {cp_cases.MICROBATCHES}")
    refs = _reference(arch, attn, kind)
    seen: set[str] = set()
    for r, mine in zip(results, got, strict=True):
        where = f"{key} on pp {r['pp']} cp {r['cp']}"
        no_crash(mine, where)
        assert all(mine["sharded"]), where
        seen |= _check_steps(where, mine["steps"], refs)
    assert seen == set(refs[0][1]), f"{key}: no gradient for {sorted(set(refs[0][1]) - seen)}"


def test_every_generator_ran() -> None:
    ran = {
        cp_cases.CASES[k][1]
        for k, g in cp_cases.results()[0]["cases"].items()
        if not (isinstance(g, str) and g.startswith("skipped"))
    }
    assert ran == {cp_cases.CASES[k][1] for k in cp_cases.CASES}, ran


def test_what_cannot_be_context_parallel_is_refused_in_one_line() -> None:
    refusals = cp_cases.results()[0]["refusals"]
    no_crash(refusals, "refusals")
    expected = {
        "odd sequence": r"sequence has 6 tokens: use a sequence length divisible by 4",
        "loss": r"cannot take one rank's tokens: pass loss_fn=zeropipe.causal_lm_loss",
        "unsharded": r"'cp' dimension has 2 rank\(s\) but the stages are sharded over \[1\]",
        "moe": r"mixtures of experts are not context-parallel yet",
        "model": r"split it first, then parallelize the stages",
        "twice": r"context-parallel already",
        "padding": r"takes no attention_mask \(padding\): pack the documents",
        "sequence parallel": r"use sequence_parallel=False with it",
    }
    for what, pattern in expected.items():
        message = refusals[what]
        assert re.search(pattern, message), (what, message)
        assert "\n" not in message, (what, message)


def test_tensor_and_context_parallel_together_give_the_models_own_loss_and_gradients() -> None:
    results = cp_cases.tp_results()
    refs = cp_cases.tp_reference()
    seen: set[str] = set()
    for r in results:
        where = f"pp {r['pp']} cp {r['cp']} tp {r['tp']}"
        no_crash(r["steps"], where)
        seen |= _check_steps(where, r["steps"], refs)
    assert seen == set(refs[0][1])


def _checked_case(case: str) -> list[dict[str, Any]]:
    """Every process's result of the cp launch's ``case``, its steps checked against the
    unsplit Llama's, every parameter's gradient among them."""
    refs = _reference("llama", "eager", "plain")
    seen: set[str] = set()
    outs = []
    for r in cp_cases.results():
        got = r[case]
        no_crash(got, case)
        seen |= _check_steps(case, got["steps"], refs)
        outs.append(got)
    assert seen == set(refs[0][1])
    return outs


def test_replicas_of_context_parallel_pipelines_sum_over_dp_and_cp() -> None:
    # pp 1 x dp 2 x cp 2: each replica half the rows, each cp process half its tokens
    for got in _checked_case("dp x cp"):
        assert got["replicas"] == 4  # the pipeline's replicas are its dp x cp processes
        # ... but the batch has one slice per replica, the same for its two cp processes
        assert got["slice"] == [got["slice"][2], 2, got["slice"][2]], got["slice"]


def test_microbatches_of_different_lengths_are_each_sharded_over_cp() -> None:
    # zbv at pp 2 x cp 2 over zeropipe.Microbatches of 8, 12 and 4 tokens
    ref_loss, ref_grads = cp_cases.varlen_reference()
    seen: set[str] = set()
    for r in cp_cases.results():
        got = r["microbatches"]
        no_crash(got, "microbatches")
        seen |= _check_steps(f"pp {r['pp']} cp {r['cp']}", [got], [(ref_loss, ref_grads)])
    assert seen == set(ref_grads)


def test_dp_shard_with_context_parallelism_shards_over_dp_and_cp() -> None:
    # pp 1 x dp 2 x cp 2, dp_shard=True: FSDP2 over the 4 processes of dp x cp, whose
    # reduce-scatter sums what the replicated mode's all-reduce sums
    for got in _checked_case("dp x cp dp_shard"):
        assert got["replicas"] == 4 and got["embedding"] == [64 // 4, 16], got["embedding"]


def test_dp_shard_with_context_parallelism_and_two_pipeline_ranks() -> None:
    # pp 2 x cp 2, dp_shard=True: each rank's stage sharded over its 2 cp processes
    refs = _reference("llama", "eager", "plain")
    seen: set[str] = set()
    rows: dict[int, list[int]] = {}  # pipeline rank -> its parameters' rows, over its cp ranks
    for r in cp_cases.results():
        got = r["pp x cp dp_shard"]
        where = f"pp {r['pp']} cp {r['cp']} dp_shard"
        no_crash(got, where)
        seen |= _check_steps(where, got["steps"], refs)
        held = [local[0] for local, _ in got["held"]]
        rows[r["pp"]] = [
            a + b for a, b in zip(rows.get(r["pp"], [0] * len(held)), held, strict=True)
        ]
        assert all(local[0] < whole[0] for local, whole in got["held"]), (where, got["held"])
    assert seen == set(refs[0][1])
    for r in cp_cases.results():  # the two cp ranks' shards make each whole parameter
        whole = [w[0] for _, w in r["pp x cp dp_shard"]["held"]]
        assert rows[r["pp"]] == whole, (r["pp"], rows, whole)


def test_the_shards_balance_early_and_late_chunks() -> None:
    assert shard_indices(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert shard_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    every = torch.cat([shard_indices(24, r, 3) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    with pytest.raises(PipelineError, match="divisible by 6"):
        shard_indices(10, 0, 3)


def test_the_sharded_loss_adds_up_to_the_whole_sequences() -> None:
    # The cp ranks' sums and counts add up to causal_lm_loss's on the whole rows.
    torch.manual_seed(0)
    logits = torch.randn(3, 8, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 8))
    labels[0, 3] = labels[2, :5] = -100
    whole_sum, whole_count = zeropipe.causal_lm_loss.sum_and_count(logits, labels)
    sums = counts = 0
    for rank in range(2):
        shard = zeropipe.causal_lm_loss.context_parallel(rank, 2)
        local = logits[:, shard_indices(8, rank, 2)]
        total, count = shard.sum_and_count(local, labels)
        assert int(count) == int(shard.count(labels))
        sums, counts = sums + total, counts + count
    assert abs(float(sums) - float(whole_sum)) <= 1e-12 and int(counts) == int(whole_count)
    with pytest.raises(PipelineError, match="not cp rank 0's"):
        zeropipe.causal_lm_loss.context_parallel(0, 2).sum_and_count(logits, labels)
