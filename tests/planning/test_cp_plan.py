"""Context-parallel plans: each sequence sharded over cp GPUs with ring attention.  The
linears and memory-bound work see 1/cp of the tokens, causal attention of the whole sequence
is divided evenly, activations per GPU fall by cp, the ring's key/value transfers are priced
on the link they cross (NVLink while tp x cp fits a node, the network beyond) and only where
they outlast the attention they overlap (a ring step by step, an all-gather under the first
sub-attention only); gradients are reduced, and FSDP shards, over dp x cp; a run's kernels
(attention's own efficiency, float8 linears, keys and values as wide as the queries); what
cannot be priced is refused in one line; ``zeropipe plan --cp``; and torchtitan's published
long-context H100 tables (``benchmarks/long_context_table.py``).  No torch."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import pytest

from tests.planning import benchmark_modules
from zeropipe.apps import cli
from zeropipe.core.errors import ScheduleError
from zeropipe.planning.cluster import Candidate, Config, fixed_costs, search, spec_costs
from zeropipe.planning.pricing.context_parallel import (
    GRADIENT_BYTES,
    KEY_VALUE_COPY_BYTES,
    OUTPUT_MERGE_BYTES,
    RingAttention,
    gather_exposed,
    gathered_bytes,
    ring_crosses_nodes,
    ring_exposed,
    ring_step_time,
    ring_steps,
)
from zeropipe.planning.pricing.tensor_parallel import TP_LINK_EFFICIENCY
from zeropipe.planning.pricing.transformer import FLOAT8_LINEAR_SPEEDUP, Kernels
from zeropipe.planning.specs import (
    HardwareSpec,
    StagePrice,
    costs_from_spec,
    load_hardware,
    load_model,
    price_stages,
)

H100 = load_hardware("h100-sxm")
LLAMA_8B = load_model("llama-3-8b")
SEQ = 16_384


def _block(
    cp: int,
    *,
    seq: int = SEQ,
    tp: int = 1,
    hardware: HardwareSpec = H100,
    kernels: Kernels | None = None,
) -> StagePrice:
    """One block's price (a stage of one block, without embedding or head: a middle one)."""
    one = replace(LLAMA_8B, layers=3)
    return price_stages(
        one, hardware, stages=3, seq=seq, cp=cp, tp=tp, blocks=[1, 1, 1], kernels=kernels
    )[1]


# -- what a block costs ---------------------------------------------------------------------------


def test_cp_1_and_the_default_kernels_price_exactly_as_without_them() -> None:
    plain = costs_from_spec(LLAMA_8B, H100, stages=4, seq=SEQ, dp=2, recompute=True)
    one = costs_from_spec(LLAMA_8B, H100, stages=4, seq=SEQ, dp=2, recompute=True, cp=1)
    assert one == plain and "cp" not in one.meta
    default = costs_from_spec(LLAMA_8B, H100, stages=4, seq=SEQ, dp=2, kernels=Kernels(), cp=1)
    assert default == costs_from_spec(LLAMA_8B, H100, stages=4, seq=SEQ, dp=2)
    assert "kernels" not in default.meta
    # cp 1 has nothing to move: the rotation does not change its price.
    gathered = Kernels(ring=RingAttention("allgather", expanded_kv=True))
    assert _block(1, kernels=gathered) == _block(1)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_the_linears_and_activations_are_one_cps_share(cp: int) -> None:
    whole, part = _block(1), _block(cp)
    # W is the linears' weight gradient only: proportional to the tokens a GPU holds.
    assert pytest.approx(whole.W / cp, rel=1e-12) == part.W
    assert part.act == pytest.approx(whole.act / cp, rel=1e-12)
    assert part.params == whole.params  # weights whole


def test_causal_attention_of_the_whole_sequence_is_divided_evenly() -> None:
    # Doubling the sequence over twice the GPUs keeps each GPU's tokens: the linears cost
    # the same, attention doubles (a quadratic cost over twice the GPUs), and on NVLink the
    # ring hides under it, so F grows by exactly one GPU's attention: 2 t s d / rate.
    short, long = _block(1, seq=SEQ), _block(2, seq=2 * SEQ)
    rate = H100.peak("bf16") * 0.6
    attention = 2.0 * SEQ * SEQ * LLAMA_8B.dim / rate  # one GPU's tokens x the short seq
    assert pytest.approx(attention, rel=1e-9) == long.F - short.F
    assert pytest.approx(2.5 * attention, rel=1e-9) == long.I - short.I


def test_the_ring_adds_only_what_outlasts_the_attention_it_overlaps() -> None:
    assert ring_exposed(1, 5.0, 1.0) == 0.0
    assert ring_exposed(4, 1.0, 8.0) == 0.0  # each step's 1 s under 2 s of attention
    assert ring_exposed(4, 3.0, 8.0) == pytest.approx(3 * (3.0 - 2.0))
    # On a link a thousand times slower, the ring shows: (cp - 1) steps of the keys and
    # values beyond the attention of the shard in hand, and twice the bytes backward.
    slow = replace(H100, intra_bandwidth=H100.intra_bandwidth / 1000)
    fast, crawl = _block(4), _block(4, hardware=slow)
    tokens = SEQ // 4
    keys_values = 2.0 * tokens * LLAMA_8B.kv_dim * 2
    step = ring_step_time(keys_values, slow.intra_bandwidth, slow.intra_latency)
    attention = 2.0 * tokens * SEQ * LLAMA_8B.dim / (H100.peak("bf16") * 0.6)
    assert step == pytest.approx(
        slow.intra_latency + keys_values / (slow.intra_bandwidth * TP_LINK_EFFICIENCY)
    )
    assert pytest.approx(3 * (step - attention / 4), rel=1e-9) == crawl.F - fast.F
    assert crawl.W == fast.W


def test_an_all_gather_hides_under_the_first_sub_attention_only() -> None:
    assert gather_exposed(1, 5.0, 1.0) == 0.0
    assert gather_exposed(4, 1.0, 16.0) == 0.0  # 3 s of shards under 4 s of attention
    assert gather_exposed(4, 2.0, 16.0) == pytest.approx(3 * 2.0 - 4.0)
    # Forward: the other cp - 1 shards beyond the first of cp sub-attentions.  Backward: the
    # all-gather again, the float32 gradients' ring steps, and the last of them exposed.
    gather = Kernels(ring=RingAttention("allgather"))
    slow = replace(H100, intra_bandwidth=H100.intra_bandwidth / 1000)
    fast, crawl = _block(4, kernels=gather), _block(4, hardware=slow, kernels=gather)
    tokens = SEQ // 4
    shard = ring_step_time(2.0 * tokens * LLAMA_8B.kv_dim * 2, slow.intra_bandwidth, 10e-6)
    gradients = 2.0 * tokens * LLAMA_8B.kv_dim * GRADIENT_BYTES
    grads = ring_step_time(gradients, slow.intra_bandwidth, 10e-6)
    attention = 2.0 * tokens * SEQ * LLAMA_8B.dim / (H100.peak("bf16") * 0.6)
    assert slow.intra_latency == 10e-6
    assert pytest.approx(3 * shard - attention / 4, rel=1e-9) == crawl.F - fast.F
    backward = (3 * shard - 2.5 * attention / 4) + 3 * (grads - 2.5 * attention / 4) + grads
    # On NVLink all of it hides but the last gradient step.
    last = ring_step_time(gradients, H100.intra_bandwidth, 10e-6)
    assert pytest.approx(backward - last, rel=1e-9) == crawl.I - fast.I
    assert crawl.W == fast.W


def test_keys_and_values_as_wide_as_the_queries_move_heads_over_kv_heads_the_bytes() -> None:
    link = {"gpus_per_node": 8, "intra": (450e9, 0.0), "inter": (50e9, 0.0)}
    queries = (LLAMA_8B.dim, LLAMA_8B.heads)
    shard = {"tokens": SEQ, "element_bytes": 2, "queries": queries, **link}
    own = ring_steps(2, 1, key_values=(1024, 8), **shard)
    wide = Kernels(ring=RingAttention(expanded_kv=True)).key_values(LLAMA_8B)
    assert wide == queries
    expanded = ring_steps(2, 1, key_values=wide, **shard)
    assert expanded["ring_f"] == pytest.approx(4 * own["ring_f"])  # 32 heads over 8
    gathered = ring_steps(2, 1, key_values=wide, ring=RingAttention("allgather"), **shard)
    assert gathered["ring_i"] == pytest.approx(expanded["ring_f"] * GRADIENT_BYTES / 2)
    assert gathered["rotation"] == "allgather" and own["rotation"] == "ring"


def test_torchs_merges_after_each_sub_attention_are_priced_by_their_bytes() -> None:
    # The all-gather rotation (torch's ring attention) reads and writes the float32 output
    # and the keys' and values' copies at every sub-attention after the first.
    link = {"gpus_per_node": 8, "intra": (450e9, 0.0), "inter": (50e9, 0.0)}
    queries = (LLAMA_8B.dim, LLAMA_8B.heads)
    shard = {"tokens": SEQ, "element_bytes": 2, "queries": queries, **link}
    kv = (LLAMA_8B.kv_dim, LLAMA_8B.kv_heads)
    steps = ring_steps(4, 2, key_values=kv, ring=RingAttention("allgather"), **shard)
    output, keys_values = SEQ * LLAMA_8B.dim / 2, 2 * SEQ * LLAMA_8B.kv_dim / 2  # over tp 2
    forward, backward = (
        o * output + k * keys_values
        for o, k in zip(OUTPUT_MERGE_BYTES, KEY_VALUE_COPY_BYTES, strict=True)
    )
    assert (steps["merge_f"], steps["merge_i"]) == (forward, backward)
    assert "merge_f" not in ring_steps(4, 2, key_values=kv, **shard)  # the ring: none priced
    # A block pays them cp - 1 times at the memory-bound rate; on NVLink the transfers hide
    # (but the all-gather rotation's last gradient step).
    ring, gather = _block(4), _block(4, kernels=Kernels(ring=RingAttention("allgather")))
    gpu = {**shard, "tokens": SEQ // 4}
    one = ring_steps(4, 1, key_values=kv, ring=RingAttention("allgather"), **gpu)
    rate = H100.memory_bandwidth * 0.7
    assert pytest.approx(3 * one["merge_f"] / rate, rel=1e-9) == gather.F - ring.F
    last = ring_step_time(2.0 * SEQ // 4 * LLAMA_8B.kv_dim * GRADIENT_BYTES, 450e9, 10e-6)
    assert pytest.approx(3 * one["merge_i"] / rate + last, rel=1e-9) == gather.I - ring.I


def test_zeropipes_own_cp_prices_the_whole_rectangle_its_exposed_transfers_and_its_mask() -> None:
    # Rotation "gather", as zeropipe.adapters.context_parallel runs it: the keys and values
    # gathered whole (their own width) and waited on, one attention under a dense mask (no
    # causal block skipped), the gradients summed back after it; the other ranks' keys and
    # values and the mask (a byte per local x whole pair) kept for backward.
    ring, own = _block(4), _block(4, kernels=Kernels(ring=RingAttention("gather")))
    local = SEQ // 4
    rate = H100.peak("bf16") * 0.6
    attention = 2.0 * local * SEQ * LLAMA_8B.dim / rate  # the causal half's seconds forward
    shard = ring_step_time(2.0 * local * LLAMA_8B.kv_dim * 2, 450e9, 10e-6)  # bf16 keys, values
    ring_f = ring_exposed(4, shard, attention)  # what the ring leaves exposed
    assert pytest.approx(attention + 3 * shard - ring_f, rel=1e-9) == own.F - ring.F
    ring_i = ring_exposed(4, ring_step_time(2 * shard_bytes(local), 450e9, 10e-6), 2.5 * attention)
    assert pytest.approx(2.5 * attention + 3 * shard - ring_i, rel=1e-9) == own.I - ring.I
    assert own.W == ring.W
    kept = 3 * local * 2.0 * LLAMA_8B.kv_dim * 2 + local * SEQ
    assert pytest.approx(kept, rel=1e-12) == own.act - ring.act
    assert gathered_bytes(1, tokens=local, seq=SEQ, key_values=1.0) == 0.0


def shard_bytes(tokens: int) -> float:
    """Bytes of one GPU's keys and values of ``tokens`` tokens (Llama 3 8B, bf16)."""
    return 2.0 * tokens * LLAMA_8B.kv_dim * 2


def test_attention_runs_at_its_own_efficiency_and_float8_speeds_the_blocks_linears() -> None:
    plain = _block(1)
    flash = _block(1, kernels=Kernels(attention_efficiency=0.3))
    attention = 2.0 * SEQ * SEQ * LLAMA_8B.dim  # forward FLOPs
    slower = 1 / (H100.peak("bf16") * 0.3) - 1 / (H100.peak("bf16") * 0.6)
    assert pytest.approx(attention * slower, rel=1e-9) == flash.F - plain.F
    assert pytest.approx(2.5 * attention * slower, rel=1e-9) == flash.I - plain.I
    assert flash.W == plain.W and flash.act == plain.act
    float8 = _block(1, kernels=Kernels(float8_linears=True))
    assert pytest.approx(plain.W / FLOAT8_LINEAR_SPEEDUP, rel=1e-12) == float8.W
    linears = plain.W  # forward and input gradient cost the linears' W each
    assert pytest.approx(plain.F - float8.F, rel=1e-9) == linears * (1 - 1 / FLOAT8_LINEAR_SPEEDUP)
    assert float8.act == plain.act and float8.params == plain.params


def test_kernels_record_themselves_and_what_they_cannot_price_is_refused() -> None:
    kernels = Kernels(0.33, float8_linears=True, ring=RingAttention("allgather"))
    costs = costs_from_spec(LLAMA_8B, H100, stages=2, seq=SEQ, cp=2, kernels=kernels)
    assert costs.meta["kernels"] == {
        "attention_efficiency": 0.33,
        "float8_linears": True,
        "cp_rotation": "allgather",
        "cp_expanded_kv": False,
    }
    with pytest.raises(
        ScheduleError, match="cp rotation 'p2p': give one of ring, allgather, gather"
    ):
        RingAttention("p2p")
    with pytest.raises(ScheduleError, match=r"attention_efficiency = 1\.5 must be in"):
        Kernels(1.5)
    with pytest.raises(ScheduleError, match="kernels are priced for a dense model only"):
        costs_from_spec("qwen3-30b-a3b", H100, stages=2, seq=4096, kernels=kernels)


def test_the_ring_crosses_the_network_once_tp_x_cp_outgrows_a_node() -> None:
    assert not ring_crosses_nodes(1, 8, 8)
    assert not ring_crosses_nodes(2, 4, 8) and not ring_crosses_nodes(8, 1, 8)
    assert ring_crosses_nodes(2, 8, 8) and ring_crosses_nodes(16, 1, 8)
    assert ring_crosses_nodes(3, 1, 8)  # 3 of 8: the next group straddles two nodes
    slow_network = replace(H100, inter_bandwidth=H100.inter_bandwidth / 1000)
    inside, across = _block(2, tp=4), _block(2, tp=8)
    assert _block(2, tp=4, hardware=slow_network) == inside  # the network is not used
    assert _block(2, tp=8, hardware=slow_network).F > across.F


def test_gradients_are_reduced_and_fsdp_shards_over_dp_x_cp() -> None:
    costs = costs_from_spec(LLAMA_8B, H100, stages=2, seq=SEQ, dp=2, cp=4)
    assert costs.dp == 8 and costs.meta["cp"] == 4
    assert costs.meta["replica_link"] == "node"
    factory = spec_costs(LLAMA_8B, H100, seq=SEQ, fsdp=True)
    plain = factory(Config(2, 8, 1, 4, 2))
    sharded = factory(Config(2, 2, 1, 4, 2, cp=4))
    assert sharded.stages[0].weights == pytest.approx(plain.stages[0].weights)


@pytest.mark.parametrize(
    ("changes", "what"),
    [
        ({"cp": 0}, "cp = 0 must be a whole number >= 1"),
        ({"cp": 3}, "must split into 2 x cp = 6 equal chunks"),
        ({"cp": 2, "attention": "unfused"}, "ring attention is flash style"),
    ],
)
def test_what_cannot_be_priced_is_refused_in_one_line(changes: dict[str, Any], what: str) -> None:
    with pytest.raises(ScheduleError, match=what) as caught:
        costs_from_spec(LLAMA_8B, H100, stages=2, seq=SEQ, **changes)
    assert "\n" not in str(caught.value)


def test_a_mixture_of_experts_and_a_measured_model_refuse_cp() -> None:
    with pytest.raises(ScheduleError, match="context parallelism of a mixture-of-experts"):
        costs_from_spec("qwen3-30b-a3b", H100, stages=2, seq=4096, cp=2)
    measured = costs_from_spec(LLAMA_8B, H100, stages=2, seq=SEQ)
    with pytest.raises(ScheduleError, match="cannot price cp 2"):
        fixed_costs(measured)(Config(2, 1, 1, 4, 2, cp=2))


# -- the search and the command ---------------------------------------------------------------------


def test_the_search_spends_gpus_on_cp_and_keeps_the_batch_over_dp() -> None:
    ranking = search(
        gpus=8,
        layers=LLAMA_8B.layers,
        global_batch=2,
        costs_for=spec_costs(LLAMA_8B, H100, seq=65_536, fsdp=True),
        memory=H100.memory,
        schedules=["1f1b"],
        microbatch_sizes=[1],
        flops_per_sample=LLAMA_8B.flops_per_token(65_536) * 65_536,
        peak_flops=H100.peak("bf16"),
        seq=65_536,
        top=50,
        cp_options=[1, 2, 4, 8],
    )
    cands = ranking.candidates
    assert {c.cp for c in cands} > {1}
    for c in cands:
        assert c.pp * c.dp * c.tp * c.cp == 8 and 2 % c.dp == 0
    best = ranking.best
    assert best is not None and best.fits and best.cp > 1
    # 65,536 tokens' activations do not fit one GPU of a pipeline without cp.
    assert all(not c.fits for c in cands if c.cp == 1)
    assert Candidate.from_dict(best.to_dict()) == best
    assert "cp" not in replace(best, cp=1).to_dict()


def test_zeropipe_plan_searches_cp(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main([
        "plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "65536",
        "--global-batch", "4", "--cp", "1,2,4", "--tp", "1", "--pp", "1,2", "--fsdp",
        "--schedules", "1f1b", "--microbatch-sizes", "1", "--top", "5", "--quiet",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "context parallel cp in {1,2,4}: ring attention as Megatron-LM runs it" in out
    assert "(zeropipe's own cp: --cp-attention gather)" in out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert header.split()[:5] == ["#", "pp", "dp", "tp", "cp"]


def test_zeropipe_plan_prices_zeropipes_own_cp_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = [
        "plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-sxm", "--seq", "16384",
        "--global-batch", "4", "--tp", "1", "--pp", "1", "--fsdp",
        "--schedules", "1f1b", "--microbatch-sizes", "1", "--top", "1", "--quiet",
    ]  # fmt: skip
    steps = {}
    for how in ("ring", "gather"):
        assert cli.main([*base, "--cp", "4", "--cp-attention", how]) == 0
        out = capsys.readouterr().out
        row = next(line for line in out.splitlines() if line.startswith("1 "))
        steps[how] = float(row.split()[10])
    assert "keys and values gathered whole as zeropipe's own cp does, under a dense mask" in out
    assert steps["gather"] > steps["ring"]  # the whole rectangle, nothing hidden
    assert cli.main([*base, "--cp-attention", "gather"]) != 0  # no --cp to apply it to
    assert "--cp-attention gather needs --cp" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "what"),
    [
        (["--cp", "3"], "--cp 3: cp 3: the sequence of 4096 tokens must split into 2 x cp"),
        (["--cp", "16"], "--cp 16 does not divide --gpus 8"),
    ],
)
def test_zeropipe_plan_refuses_a_cp_it_cannot_price(
    capsys: pytest.CaptureFixture[str], flags: list[str], what: str
) -> None:
    base = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-sxm"]
    code = cli.main([*base, "--seq", "4096", "--global-batch", "8", *flags])
    assert code != 0 and what in capsys.readouterr().err


def test_zeropipe_plan_sizes_its_largest_search_with_cp(capsys: pytest.CaptureFixture[str]) -> None:
    # cp 8 on 64 GPUs at pp 8 leaves one replica: 20,000 microbatches a pipeline, refused
    # up front (without cp the largest is 8 replicas of 2,500, which runs).
    code = cli.main([
        "plan", "--model", "llama-3-8b", "--gpus", "64", "--gpu", "h100-sxm", "--seq", "8192",
        "--global-batch", "20000", "--pp", "8", "--tp", "1", "--cp", "1,8", "--quiet",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code != 0 and "the largest configuration, pp 8 x dp 1 x tp 1" in err


def test_zeropipe_plan_refuses_cp_for_a_mixture_of_experts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100-sxm"]
    code = cli.main([*base, "--seq", "4096", "--global-batch", "8", "--cp", "2"])
    assert code != 0 and "--cp 2: qwen3-30b-a3b: context parallelism" in capsys.readouterr().err


# -- the published tables -------------------------------------------------------------------------


lt = benchmark_modules.load("long_context_table")


def test_the_published_tables_are_consistent_with_themselves() -> None:
    for row in lt.ROWS:
        assert row.gpus == row.pp * row.tp * row.fsdp * row.cp
        assert row.seq // row.cp == 32_768  # every row: the tokens a GPU holds
        assert row.seq % (2 * row.cp) == 0


@cache
def _rows(kernels: Kernels = lt.TORCHTITAN) -> tuple[dict[str, Any], ...]:
    """The benchmark's rows, priced once per set of kernels."""
    return tuple(lt.run(lt.ROWS, kernels))


def test_the_float8_speedup_reproduces_torchtitans_table_1() -> None:
    # FLOAT8_LINEAR_SPEEDUP is where the 8B's Float8 step on 8 GPUs (Table 1) comes out.
    check = lt.float8_check()
    assert check["published"] == pytest.approx(8532 / 6667)
    assert check["predicted"] == pytest.approx(check["published"], rel=0.01)


def test_predicted_throughput_falls_with_the_sequence_as_published() -> None:
    rows = _rows()
    for table in (2, 6):
        mine = [r for r in rows if r["table"] == table]
        assert [r["seq"] for r in mine] == sorted(r["seq"] for r in mine)
        predicted = [r["predicted_ratio"] for r in mine]
        published = [r["published_ratio"] for r in mine]
        assert predicted == sorted(predicted, reverse=True) and predicted[0] == 1.0
        assert published == sorted(published, reverse=True)


def test_the_rows_kernels_explain_part_of_the_fall_one_efficiency_misses() -> None:
    # Attention at FlashAttention-2's rate, Float8 linears and torch's all-gather: every
    # row's ratio nearer the published than with every matmul at one efficiency, the
    # worst row's error less than a third of what it was.
    one, rows = _rows(Kernels()), _rows()
    for plain, kernels in zip(one, rows, strict=True):
        if plain["published_ratio"] != 1.0:
            assert abs(kernels["ratio"] - 1) < abs(plain["ratio"] - 1)
    assert max(abs(r["ratio"] - 1) for r in rows) < max(abs(r["ratio"] - 1) for r in one) / 3


def test_predicted_steps_grow_steadily_row_to_row_where_the_published_do_not() -> None:
    # Fixed costs plus costs in proportion to cp: each row's step over the one before rises
    # steadily towards 2.  torchtitan's rows rise and fall (8B: 1.53, 2.37, 1.95; 405B:
    # 1.62, 1.52, 1.94), which no step of that form reproduces row for row.
    rows = _rows()
    for table in (2, 6):
        growth = lt.step_growth(rows, table)
        predicted, published = growth["predicted"], growth["published"]
        assert predicted == sorted(predicted) and all(1 < g < 2 for g in predicted)
        assert published not in (sorted(published), sorted(published, reverse=True))


def test_the_rows_hardware_hardly_moves_the_ratios_and_only_a_fitted_attention_rate_would() -> None:
    # The what-ifs the benchmark takes (--rows-hardware, --attention-efficiency): the H100s
    # the rows ran on move no ratio by 2 points; attention at 0.20 of the peak, not the 0.33
    # FlashAttention-2 is measured at, is what it would take to bring every row inside.
    priced = _rows()
    assert max(abs(r["ratio"] - 1) for r in priced) > lt.BAR
    for mine, theirs in zip(
        lt.run(lt.ROWS, lt.TORCHTITAN, lt.rows_hardware()), priced, strict=True
    ):
        assert abs(mine["ratio"] - theirs["ratio"]) < 0.02
    fitted = lt.run(lt.ROWS, replace(lt.TORCHTITAN, attention_efficiency=0.2))
    assert max(abs(r["ratio"] - 1) for r in fitted) <= lt.BAR


# Rows the priced mechanisms leave outside the bar (python benchmarks/long_context_table.py).
OUTSIDE = {
    "T2 FSDP 2 CP 4": "+25%",
    "T2 FSDP 1 CP 8": "+30%",
    "T6 FSDP 4 CP 2": "+20.02%",
    "T6 FSDP 2 CP 4": "+24%",
    "T6 FSDP 1 CP 8": "+38%",
}


def _checked(row: Any) -> Any:
    """A row's check, xfailed (strictly) where the pricing leaves it outside the bar."""
    why = OUTSIDE.get(row.name)
    if why is None:
        return pytest.param(row.name, id=row.name)
    reason = (
        f"issue 44 item 4: {row.name} {why}: torchtitan's rows fall faster than attention at "
        f"FlashAttention-2's rate, the all-gather's exposed transfers and torch's merges "
        f"explain; see docs/planning.md, Context parallelism"
    )
    return pytest.param(row.name, id=row.name, marks=pytest.mark.xfail(strict=True, reason=reason))


@pytest.mark.parametrize("name", [_checked(r) for r in lt.ROWS if r.cp > 1])
def test_each_rows_ratio_to_its_tables_first_is_within_20_percent(name: str) -> None:
    (row,) = [r for r in _rows() if r["row"] == name]
    assert abs(row["ratio"] - 1) <= lt.BAR
