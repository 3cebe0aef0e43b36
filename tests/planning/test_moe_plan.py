"""Mixture-of-experts plans: Hugging Face MoE configs read (Qwen3-MoE, Mixtral, DeepSeek-V3
with its dense first blocks, shared expert, latent attention and group-limited routing) or
refused naming the field; expert compute by active weights; the all-to-all of expert
parallelism on the link it crosses; expert weights in memory over ep (and dp / ep with
FSDP); tensor parallelism cutting attention, dense FFNs and shared experts, not the routed
experts; the overlap of DualPipeV's pairs; ``zeropipe plan --ep`` and ``--tp``; and NeMo AutoModel's
published DGX-H100 table (``benchmarks/moe_table.py``) predicted within 25%.  No torch."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.planning import benchmark_modules
from zeropipe.apps import cli
from zeropipe.core.errors import ScheduleError
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.planning.cluster import Config, fixed_costs, search, spec_costs
from zeropipe.planning.pricing.moe import (
    A2A_LINK_EFFICIENCY,
    all_to_all_time,
    copies_per_token,
    expert_share,
    pair_overlap,
    price_moe_block,
)
from zeropipe.planning.pricing.tensor_parallel import matmul_share
from zeropipe.planning.pricing.transformer import LayerPrice, LayerRun
from zeropipe.planning.specs import (
    DEFAULT_STATE_BYTES,
    costs_from_spec,
    load_hardware,
    load_model,
    price_stages,
)

H100 = load_hardware("h100-sxm")

QWEN3_30B = {  # Qwen/Qwen3-30B-A3B config.json, the keys the planner reads
    "model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "tie_word_embeddings": False,
}  # fmt: skip
MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 config.json
    "model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
}  # fmt: skip
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json
    "model_type": "deepseek_v3", "num_hidden_layers": 61, "hidden_size": 7168,
    "num_attention_heads": 128, "num_key_value_heads": 128, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
    "n_group": 8, "topk_group": 4, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 129280, "tie_word_embeddings": False,
}  # fmt: skip


def _folder(tmp_path: Path, config: dict[str, Any], **changes: Any) -> Path:
    """A model folder holding ``config`` with ``changes`` as its config.json (None: key left out)."""
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir(exist_ok=True)
    merged = {**config, **changes}
    path.write_text(json.dumps({k: v for k, v in merged.items() if v is not None}))
    return path.parent


def _read(tmp_path: Path, config: dict[str, Any], **changes: Any) -> Any:
    return load_model(str(_folder(tmp_path, config, **changes)))


# -- reading configs --------------------------------------------------------------------------


def test_the_three_families_read_with_their_published_sizes(tmp_path: Path) -> None:
    qwen = _read(tmp_path, QWEN3_30B)
    assert (qwen.experts, qwen.experts_per_token, qwen.expert_ffn) == (128, 8, 768)
    assert qwen.dense_blocks == () and qwen.is_moe
    # Qwen's "30.5B total, 3.3B activated"; Mixtral's 46.7B / 12.9B; DeepSeek's 671B / 37B.
    assert qwen.params() / 1e9 == pytest.approx(30.5, abs=0.05)
    assert qwen.active_params() / 1e9 == pytest.approx(3.35, abs=0.05)
    mixtral = _read(tmp_path, MIXTRAL_8X7B)
    assert (mixtral.experts, mixtral.expert_ffn, mixtral.shared_experts) == (8, 14336, 0)
    assert mixtral.params() / 1e9 == pytest.approx(46.7, abs=0.05)
    assert mixtral.active_params() / 1e9 == pytest.approx(12.9, abs=0.05)
    ds = _read(tmp_path, DEEPSEEK_V3)
    assert ds.dense_blocks == (0, 1, 2) and ds.shared_experts == 1
    assert ds.mla is not None and ds.mla.qk_head_dim == 192 and ds.mla.kv_lora_rank == 512
    assert (ds.expert_groups, ds.groups_per_token) == (8, 4)
    assert ds.params() / 1e9 == pytest.approx(671.0, abs=0.1)
    assert ds.active_params() / 1e9 == pytest.approx(37.5, abs=0.1)
    # The shipped specs are these configs.
    shipped = load_model("deepseek-v3")
    assert replace(shipped, name=ds.name, source=ds.source) == ds
    assert load_model("qwen3-30b-a3b").params() == qwen.params()


def test_dense_blocks_follow_each_familys_rule(tmp_path: Path) -> None:
    # Qwen3-MoE: experts where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers.
    qwen = _read(tmp_path, QWEN3_30B, decoder_sparse_step=2, mlp_only_layers=[1, 47])
    moe = qwen.moe_blocks()
    assert moe[:4] == [False, False, False, True] and not moe[47] and moe.count(True) == 22
    # DeepSeek: experts from first_k_dense_replace on, every moe_layer_freq-th block.
    ds = _read(tmp_path, DEEPSEEK_V3, first_k_dense_replace=1, moe_layer_freq=2)
    assert ds.moe_blocks()[:5] == [False, False, True, False, True]
    lite = _read(tmp_path, DEEPSEEK_V3, q_lora_rank=None)  # V2-Lite-like: no query latent
    assert lite.mla is not None and lite.mla.q_lora_rank == 0
    assert lite.attention_params() > ds.attention_params() - 1536 * 7168


@pytest.mark.parametrize(
    ("config", "changes", "what"),
    [
        (QWEN3_30B, {"num_experts_per_tok": None}, "no num_experts_per_tok"),
        (QWEN3_30B, {"num_experts_per_tok": 200}, "num_experts_per_tok = 200 exceeds"),
        (QWEN3_30B, {"moe_intermediate_size": 0}, "moe_intermediate_size = 0"),
        (QWEN3_30B, {"mlp_only_layers": "all"}, "mlp_only_layers = 'all'"),
        (MIXTRAL_8X7B, {"num_local_experts": 2.5}, "num_local_experts = 2.5"),
        (DEEPSEEK_V3, {"kv_lora_rank": None}, "no kv_lora_rank"),
        (DEEPSEEK_V3, {"moe_layer_freq": 0}, "moe_layer_freq = 0"),
        (DEEPSEEK_V3, {"n_group": 3}, "expert_groups = 3 must divide the 256 experts"),
        ({**QWEN3_30B, "model_type": "qwen2_moe"}, {}, "model_type 'qwen2_moe' has num_experts"),
        ({**MIXTRAL_8X7B, "model_type": "dbrx"}, {}, "has num_local_experts = 8"),
    ],
)
def test_what_cannot_be_priced_is_refused_naming_the_field(
    tmp_path: Path, config: dict[str, Any], changes: dict[str, Any], what: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        _read(tmp_path, config, **changes)
    assert what in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_sequence_parallelism_uneven_shared_experts_and_stray_ep_are_refused() -> None:
    qwen, dense = load_model("qwen3-30b-a3b"), load_model("llama-3-8b")
    price = {"stages": 2, "seq": 4096, "pp": 2, "dp": 8}
    with pytest.raises(ScheduleError, match="tp 2 with sequence parallelism"):
        costs_from_spec(qwen, H100, tp=2, **price)  # sequence_parallel=True by default
    costs_from_spec(qwen, H100, tp=1, **price)  # at tp 1 there is nothing to cut
    odd = replace(load_model("deepseek-v3"), expert_ffn=2052)  # a 2052-wide shared expert
    with pytest.raises(ScheduleError, match=r"tp 8 must divide the shared experts' width \(2052"):
        costs_from_spec(odd, H100, tp=8, sequence_parallel=False, **price)
    with pytest.raises(ScheduleError, match="llama-3-8b has no experts: ep 2 shards nothing"):
        costs_from_spec(dense, H100, ep=2, **price)
    with pytest.raises(ScheduleError, match="ep 3 must divide the 128 experts"):
        costs_from_spec(qwen, H100, ep=3, **{**price, "dp": 3})
    with pytest.raises(ScheduleError, match="ep 16 must divide dp 8"):
        costs_from_spec(qwen, H100, ep=16, **price)


# -- prices -----------------------------------------------------------------------------------


def _moe_block(model: Any, ep: int, seq: int = 4096) -> Any:
    """The price of one MoE block (a one-block model of ``model``'s shape)."""
    one = replace(model, layers=1, dense_blocks=())
    return price_stages(one, H100, stages=1, seq=seq, ep=ep)[0]


def test_expert_compute_is_by_active_weights_and_ep_adds_only_all_to_all() -> None:
    qwen = load_model("qwen3-30b-a3b")
    alone, sharded = _moe_block(qwen, 1), _moe_block(qwen, 8)
    # W is only the linears: 2 T n at the dense rate, the active experts at their share.
    rate = H100.peak("bf16") * 0.6
    t, h = 4096, qwen.hidden
    dense_n = qwen.attention_params() + h * qwen.experts  # attention and router
    expert_n = qwen.experts_per_token * qwen.expert_params()
    block_w = 2 * t * dense_n / rate + 2 * t * expert_n / (rate * expert_share(qwen))
    head_w = 2 * t * qwen.vocab * h / rate
    embedding_w = 2 * t * h * 2 / (H100.memory_bandwidth * 0.7)  # its scatter-add
    assert alone.W - head_w - embedding_w == pytest.approx(block_w, rel=1e-6)
    assert 0.85 < expert_share(qwen) < 1  # 768-wide experts against a 2048-wide model
    assert pytest.approx(alone.W) == sharded.W  # ep moves tokens, not work
    a2a = sharded.all_to_all_f
    assert a2a > 0 and alone.all_to_all_f == 0
    assert pytest.approx(a2a) == sharded.F - alone.F and pytest.approx(a2a) == sharded.I - alone.I
    # The routed experts are held ep ways, apart from the other weights.
    assert alone.expert_params == qwen.experts * qwen.expert_params()
    assert sharded.expert_params == alone.expert_params // 8 and sharded.params == alone.params


def test_copies_per_token_is_the_expected_count_of_distinct_holders() -> None:
    for experts, k, holders in ((8, 2, 4), (12, 3, 3), (16, 4, 8)):
        per = experts // holders
        picks = list(itertools.combinations(range(experts), k))
        mean = sum(len({e // per for e in pick}) for pick in picks) / len(picks)
        assert copies_per_token(experts, k, holders) == pytest.approx(mean)
    assert copies_per_token(256, 8, 1) == 1.0


def test_the_all_to_all_crosses_nvlink_inside_a_node_and_the_network_beyond() -> None:
    qwen = load_model("qwen3-30b-a3b")
    t, row = 4096, qwen.hidden * 2
    links = {"tp": 1, "gpus_per_node": 8, "intra": (450e9, 1e-5), "inter": (50e9, 2e-5)}
    inside = all_to_all_time(row, t, qwen, 8, **links)
    copies = copies_per_token(128, 8, 8)
    assert inside == pytest.approx(1e-5 + t * row * copies * 7 / 8 / (450e9 * A2A_LINK_EFFICIENCY))
    across = all_to_all_time(row, t, qwen, 16, **links)
    remote = copies_per_token(128, 8, 2) / 2  # the other node's share of the copies
    assert across == pytest.approx(2e-5 + t * row * remote / (50e9 * A2A_LINK_EFFICIENCY))
    assert across > inside  # fewer bytes leave the node, on a link 9 times slower
    assert all_to_all_time(row, t, qwen, 1, **links) == 0.0
    # DeepSeek-V3's router draws a token's experts from 4 of 8 groups: over 8 nodes of one
    # group each, a token reaches at most 4 of them, fewer bytes than routing anywhere.
    ds = load_model("deepseek-v3")
    limited = all_to_all_time(7168 * 2, t, ds, 64, **links)
    anywhere = all_to_all_time(7168 * 2, t, replace(ds, groups_per_token=8), 64, **links)
    assert limited < 0.75 * anywhere


def test_a_dense_model_has_no_expert_figures() -> None:
    dense = costs_from_spec("llama-3-8b", H100, stages=4, seq=2048, dp=8)
    assert dense.overlap == 0.0 and "ep" not in dense.meta
    ranking = search(
        gpus=8, layers=32, global_batch=16, memory=None, schedules=["1f1b"],
        microbatch_sizes=[1], flops_per_sample=0, peak_flops=0, seq=2048, top=3,
        costs_for=spec_costs(load_model("llama-3-8b"), H100, seq=2048),
    )  # fmt: skip
    assert all("ep" not in c.to_dict() for c in ranking.candidates)


def test_fsdp_shards_expert_state_over_the_replicas_that_hold_the_same_experts() -> None:
    qwen = load_model("qwen3-30b-a3b")
    factory = spec_costs(qwen, H100, seq=4096, fsdp=True)
    plain = spec_costs(qwen, H100, seq=4096)
    at = {"pp": 1, "dp": 8, "microbatch_size": 1, "microbatches": 8, "stages": 1}
    ep8, ep2 = factory(Config(**at, ep=8)), factory(Config(**at, ep=2))
    full = plain(Config(**at, ep=8))
    experts = 48 * 128 * qwen.expert_params()
    rest = qwen.params() - experts
    # ep 8 of dp 8: each GPU holds 1/8 of the experts, unsharded by FSDP (one replica each).
    assert ep8.stages[0].weights == pytest.approx(18 * rest / 8 + 18 * experts / 8, rel=1e-9)
    # ep 2: half the experts a GPU, sharded by FSDP over the 4 replicas holding that half.
    assert ep2.stages[0].weights == pytest.approx(18 * rest / 8 + 18 * experts / 2 / 4, rel=1e-9)
    assert full.stages[0].weights == pytest.approx(18 * rest + 18 * experts / 8, rel=1e-9)
    # The experts' gradients are reduced over dp / ep replicas: none with ep = dp.
    assert ep8.stages[0].reduced_bytes < ep2.stages[0].reduced_bytes


def test_dualpipev_pairs_hide_the_all_to_all_under_the_other_halfs_compute() -> None:
    qwen = load_model("qwen3-30b-a3b")
    costs = costs_from_spec(qwen, H100, stages=8, pp=4, dp=16, seq=4096, ep=16)
    priced = price_stages(qwen, H100, stages=8, seq=4096, ep=16)
    stage = priced[3]
    a2a_f, a2a_i, backward = stage.all_to_all_f, stage.all_to_all_i, stage.I + stage.W
    hidden = min(a2a_f, backward - a2a_i) + min(a2a_i, stage.F - a2a_f)
    assert pair_overlap([stage]) == pytest.approx(hidden / min(stage.F, backward))
    assert costs.overlap == pytest.approx(pair_overlap(priced)) and 0 < costs.overlap < 1
    schedule = build_schedule(generate("dualpipev", 4, 16))
    paired = simulate(schedule, costs).makespan
    unpaired = simulate(schedule, replace(costs, overlap=0.0)).makespan
    assert paired < unpaired
    # Without expert parallelism there is nothing to hide.
    assert costs_from_spec(qwen, H100, stages=8, pp=4, dp=16, seq=4096).overlap == 0.0


def test_dense_first_blocks_are_cut_by_their_time() -> None:
    ds = load_model("deepseek-v3")
    costs = costs_from_spec(ds, H100, stages=4, seq=4096, dp=64, ep=64)
    blocks = costs.meta["blocks"]
    assert sum(blocks) == 61 and blocks[0] > blocks[1]  # three light dense blocks first
    times = [s.F + s.I + s.W for s in costs.stages]
    assert max(times) / min(times) < 1.1


# -- tensor parallelism -------------------------------------------------------------------------


def _run(model: Any, tp: int, allreduce: float = 0.0) -> LayerRun:
    """One GPU of ``tp`` running a 4096-token microbatch at the planner's default rates."""
    rate = H100.peak("bf16") * 0.6 * matmul_share(model.hidden, tp)
    return LayerRun(
        tokens=4096, seq=4096, element_bytes=2, flop_rate=rate,
        byte_rate=H100.memory_bandwidth * 0.7, allreduce=allreduce, tp=tp,
        sequence_parallel=False,
    )  # fmt: skip


def _moe(model: Any, tp: int, allreduce: float = 0.0) -> LayerPrice:
    return price_moe_block(model, _run(model, tp, allreduce), moe=True)


def test_tp_cuts_attention_and_leaves_the_routed_experts_whole() -> None:
    qwen = load_model("qwen3-30b-a3b")
    rate, t = H100.peak("bf16") * 0.6, 4096

    def saved(model: Any, tp: int) -> float:  # W seconds (the linears) tp takes off a block
        return _moe(model, 1).W - _moe(model, tp).W

    # W is the linears only: tp takes off attention's half, at the narrower rate ...
    attention = 2 * t * qwen.attention_params() / rate
    halved = attention / 2 / matmul_share(qwen.hidden, 2)
    assert saved(qwen, 2) == pytest.approx(attention - halved, rel=1e-9)
    assert 0.5 < halved / attention < 0.6  # about half, a little more for the narrower rate
    # ... and nothing of the experts: four times as many, twice as wide, it saves the same.
    bigger = replace(qwen, experts=512, expert_ffn=1536)
    assert _moe(bigger, 1).W > 1.5 * _moe(qwen, 1).W  # twice the active experts' FLOPs
    assert saved(bigger, 2) == pytest.approx(saved(qwen, 2), rel=1e-9)
    assert saved(qwen, 4) > saved(qwen, 2)
    # Attention's flash FLOPs are cut too: the forward saves more than W does.
    assert saved(qwen, 2) < _moe(qwen, 1).F - _moe(qwen, 2).F


def test_tp_collectives_are_attentions_and_the_shared_experts() -> None:
    qwen, ds = load_model("qwen3-30b-a3b"), load_model("deepseek-v3")
    a = 1e-3  # seconds of one all-reduce of the T x h activation

    def added(model: Any, moe: bool = True) -> tuple[float, float, float]:
        plain = price_moe_block(model, _run(model, 2), moe=moe)
        reduced = price_moe_block(model, _run(model, 2, a), moe=moe)
        return reduced.F - plain.F, reduced.I - plain.I, reduced.W - plain.W

    # Qwen3-MoE: attention's all-reduce each way; its routed experts alone add none.
    assert added(qwen) == pytest.approx((a, a, 0.0))
    # DeepSeek-V3: its shared expert adds one each way; latent attention's backward sums
    # the latents' and the rotary key's gradients (1536 + 512 + 64 of 7168 wide).
    assert added(ds) == pytest.approx((2 * a, a + a * (1536 + 512 + 64) / 7168, 0.0))
    assert added(ds, moe=False)[0] == pytest.approx(2 * a)  # a dense first block's FFN
    assert price_moe_block(qwen, _run(qwen, 1, a), moe=True) == _moe(qwen, 1)  # tp 1: none


def _middle_stage(model: Any, tp: int, ep: int = 1) -> Any:
    """The middle stage of three (MoE blocks only, no embedding or head)."""
    three = replace(model, layers=4, dense_blocks=())
    return price_stages(three, H100, stages=3, seq=4096, tp=tp, ep=ep, sequence_parallel=False)[1]


def test_tp_divides_attentions_memory_not_the_routed_experts() -> None:
    qwen, ds = load_model("qwen3-30b-a3b"), load_model("deepseek-v3")
    for ep in (1, 2):
        one, two = _middle_stage(qwen, 1, ep), _middle_stage(qwen, 2, ep)
        n = one.blocks
        assert n == two.blocks >= 1
        # The routed experts' weights, gradients and optimizer state: the same per GPU.
        assert two.expert_params == one.expert_params == n * 128 * qwen.expert_params() // ep
        # Attention's (no norms, no router) halve, with their state.
        assert one.params - two.params == n * qwen.attention_params() // 2
        cut = DEFAULT_STATE_BYTES * n * qwen.attention_params() / 2
        assert one.weights - two.weights == pytest.approx(cut, rel=1e-12)
        # Activations: only attention's saved q, k and v halve; the experts' are whole.
        qkv = 4096 * 2 * (qwen.dim + 2 * qwen.kv_dim) / 2
        assert one.act - two.act == pytest.approx(n * qkv, rel=1e-12)
    # Latent attention: the projections before the heads are whole on every GPU; the
    # shared expert is cut like a dense FFN.
    assert ds.mla is not None
    one, eight = _middle_stage(ds, 1), _middle_stage(ds, 8)
    heads = ds.attention_params() - ds.mla.latent_params(ds.hidden)
    shared = ds.shared_experts * ds.expert_params()
    assert one.blocks == eight.blocks
    assert one.params - eight.params == one.blocks * (heads + shared) * 7 // 8
    assert eight.expert_params == one.expert_params


def test_a_measured_cost_model_refuses_ep() -> None:
    qwen = load_model("qwen3-30b-a3b")
    measured = costs_from_spec(qwen, H100, stages=2, pp=2, dp=2, seq=4096)
    with pytest.raises(ScheduleError, match="cannot price ep 2"):
        fixed_costs(measured)(Config(2, 2, 1, 4, 2, ep=2))


# -- the command -------------------------------------------------------------------------------


def test_zeropipe_plan_searches_ep_for_a_deepseek_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = cli.main([
        "plan", "--model", str(_folder(tmp_path, DEEPSEEK_V3)), "--gpus", "256", "--gpu", "h100-sxm", "--seq",
        "4096", "--global-batch", "512", "--fsdp", "--ep", "8,64", "--pp", "4,8",
        "--schedules", "interleaved-1f1b,dualpipev", "--microbatch-sizes", "1", "--top", "3",
        "--quiet",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "671.0B parameters" in out and "37.6B active, 8 of 256 experts + 1 shared" in out
    assert "expert parallel ep in {8,64} inside dp" in out and "(FSDP over dp)" in out
    header = next(line for line in out.splitlines() if line.startswith("#"))
    assert header.split()[:5] == ["#", "pp", "dp", "tp", "ep"]


def test_zeropipe_plan_searches_tp_for_a_mixture_of_experts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    small = _folder(tmp_path, QWEN3_30B, num_hidden_layers=4, num_experts=16)
    code = cli.main([
        "plan", "--model", str(small), "--gpus", "8", "--gpu", "h100-sxm", "--seq",
        "1024", "--global-batch", "16", "--tp", "1,2", "--no-sequence-parallel", "--ep", "1,2",
        "--schedules", "1f1b", "--microbatch-sizes", "1", "--top", "30", "--quiet",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "tensor parallel tp in {1,2} inside a node, no sequence parallelism" in out
    lines = out.splitlines()
    start = next(
        n for n, line in enumerate(lines) if line.split()[:5] == ["#", "pp", "dp", "tp", "ep"]
    )
    rows = [line.split() for line in itertools.takewhile(str.strip, lines[start + 1 :])]
    layouts = {(int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}
    assert {(1, 4, 2, 1), (1, 4, 2, 2), (2, 2, 2, 2)} <= layouts  # tp 2, with and without ep
    assert all(pp * dp * tp == 8 and dp % ep == 0 for pp, dp, tp, ep in layouts)


@pytest.mark.parametrize(
    ("flags", "what"),
    [
        (["--tp", "2"], "--tp 2: qwen3-30b-a3b: tp 2 with sequence parallelism"),
        (["--ep", "3"], "--ep 3: qwen3-30b-a3b: ep 3 must divide the 128 experts"),
    ],
)
def test_zeropipe_plan_refuses_what_a_mixture_of_experts_cannot_take(
    capsys: pytest.CaptureFixture[str], flags: list[str], what: str
) -> None:
    base = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--gpu", "h100-sxm"]
    code = cli.main([*base, "--seq", "4096", "--global-batch", "64", *flags])
    assert code != 0 and what in capsys.readouterr().err


# -- the published table ------------------------------------------------------------------------


mt = benchmark_modules.load("moe_table")


def test_the_published_table_is_consistent_with_itself() -> None:
    for row in mt.ROWS:
        assert row.gpus == row.dp * row.pp * row.tp and row.fsdp == row.dp
        assert row.batch == row.dp * row.local_batch * row.accumulation
        # tokens/s per GPU is the batch over the step; TFLOP/s per GPU is that times the
        # FLOPs a token as AutoModel counts them (causal attention at half).
        assert row.tokens_per_gpu(row.step) == pytest.approx(row.tokens, rel=0.002)
        assert row.tflops_per_gpu(row.step) == pytest.approx(row.tflops, rel=0.005)


@pytest.mark.parametrize("index", range(3))
def test_each_row_at_its_own_layout_is_within_25_percent(index: int) -> None:
    row = mt.ROWS[index]
    step, peak = mt.predict(row)
    assert 0.75 <= step / row.step <= 1.25, f"{row.name}: predicted {step / row.step:.3f}"
    assert peak > 0


def test_the_planners_best_plan_for_the_qwen_row_is_a_whole_layout() -> None:
    row = mt.ROWS[2]
    best = mt.best_plan(row)
    step, _ = mt.predict(row)
    assert best.fits and best.pp * best.dp * best.tp == row.gpus and best.dp % best.ep == 0
    assert best.step_time < step  # it may recompute less than every microbatch
