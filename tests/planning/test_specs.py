"""Specs and costs_from_spec: shapes, prices, cuts, links and errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from zeropipe.core.costs import CostModel
from zeropipe.core.errors import ScheduleError
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.planning.specs import (
    HardwareSpec,
    ModelSpec,
    StagePrice,
    costs_from_spec,
    hardware_names,
    load_hardware,
    load_model,
    model_names,
    price_stages,
)

# Published parameter counts (model cards).
PUBLISHED = {"llama-2-7b": 6.74e9, "llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "gpt3-175b": 175e9}

TINY_GPU = HardwareSpec(
    name="tiny",
    flops={"bf16": 1e12},
    memory=1e9,
    memory_bandwidth=1e11,
    gpus_per_node=4,
    intra_bandwidth=1e10,
    intra_latency=1e-5,
    inter_bandwidth=1e9,
    inter_latency=1e-4,
)


def test_shipped_models_have_their_published_sizes() -> None:
    for name, params in PUBLISHED.items():
        assert load_model(name).params() == pytest.approx(params, rel=0.01), name


def test_every_shipped_spec_loads_and_says_where_it_comes_from() -> None:
    assert len(model_names()) >= 5 and len(hardware_names()) >= 3
    for name in model_names():
        assert load_model(name).source
    for name in hardware_names():
        gpu = load_hardware(name)
        assert gpu.source and gpu.peak("bf16") > 1e14
        assert gpu.inter_bandwidth < gpu.intra_bandwidth


def test_a_hugging_face_config_reads_as_its_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=160,
        vocab_size=1000,
    )
    config.save_pretrained(tmp_path)
    spec = load_model(str(tmp_path))
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads) == (3, 64, 8, 2)
    assert spec.gated and not spec.tied_embeddings
    model = transformers.LlamaForCausalLM(config)
    assert spec.params() == sum(p.numel() for p in model.parameters())


def test_a_gpt2_config_reads_as_a_plain_ffn_with_tied_embeddings(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=500)
    config.save_pretrained(tmp_path)
    spec = load_model(str(tmp_path / "config.json"))
    assert spec.tied_embeddings and not spec.gated and spec.ffn == 128
    model = transformers.GPT2LMHeadModel(config)
    # GPT-2 also has biases and learned positions, which the spec leaves out.
    counted = sum(p.numel() for n, p in model.named_parameters() if "bias" not in n)
    counted -= model.transformer.wpe.weight.numel()
    assert spec.params() == counted


LLAMA_CONFIG = {
    "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 1000,
}  # fmt: skip


def _refusal(tmp_path: Path, **changes: Any) -> str:
    """The one-line refusal of LLAMA_CONFIG with ``changes`` (None: the key removed)."""
    config = {**LLAMA_CONFIG, **changes}
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(ScheduleError) as info:
        load_model(str(path.parent))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


def test_a_config_without_torch_or_transformers_reads(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_CONFIG))
    spec = load_model(str(path))
    assert (spec.layers, spec.hidden, spec.kv_heads, spec.ffn, spec.gated) == (2, 64, 2, 160, True)


def test_bad_sizes_are_named_with_their_values_and_file(tmp_path: Path) -> None:
    # They were "missing fields" of a model named after its folder.
    message = _refusal(tmp_path, hidden_size=0, num_hidden_layers=-2)
    assert "num_hidden_layers = -2, hidden_size = 0: must be whole numbers >= 1" in message
    assert "intermediate_size" not in message  # only what is wrong
    assert "num_key_value_heads = 'two'" in _refusal(tmp_path, num_key_value_heads="two")
    assert "vocab_size = 1.5" in _refusal(tmp_path, vocab_size=1.5)
    assert "head_dim = 0" in _refusal(tmp_path, head_dim=0)
    message = _refusal(tmp_path, vocab_size=None, num_attention_heads=None)
    assert "no num_attention_heads (or n_head), vocab_size" in message


@pytest.mark.parametrize(
    ("model_type", "what"),
    [
        ("bert", "model_type 'bert' is an encoder"),
        ("roberta", "model_type 'roberta' is an encoder"),
        ("t5", "model_type 't5' is an encoder-decoder"),
        ("bart", "model_type 'bart' is an encoder-decoder"),
        ("mamba", "model_type 'mamba' is not a decoder-only transformer the planner knows"),
    ],
)
def test_model_types_other_than_known_decoders_are_refused(
    tmp_path: Path, model_type: str, what: str
) -> None:
    # A BERT config was priced as a decoder without a word.
    message = _refusal(tmp_path, model_type=model_type)
    assert what in message and "llama" in message and "gpt2" in message, message
    assert "model_type" in _refusal(tmp_path, model_type=None)


@pytest.mark.parametrize(
    ("key", "experts", "model_type", "what"),
    [
        # A DeepSeek-V3 config was priced as a dense model: its experts are read now
        # (tests/planning/test_moe_plan.py), and one without its top-k is refused.
        ("n_routed_experts", 256, "deepseek_v3", "no num_experts_per_tok"),
        ("num_local_experts", 8, "mixtral", "no num_experts_per_tok"),
        ("num_experts", 60, "qwen2_moe", "model_type 'qwen2_moe' has num_experts = 60"),
        ("num_local_experts", 8, "llama", "model_type 'llama' has num_local_experts = 8"),
    ],
)
def test_mixture_of_experts_configs_it_cannot_price_are_refused(
    tmp_path: Path, key: str, experts: int, model_type: str, what: str
) -> None:
    message = _refusal(tmp_path, model_type=model_type, **{key: experts})
    assert what in message, message


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ScheduleError, match="llama-3-8b"):
        load_model("no-such-model")
    with pytest.raises(ScheduleError, match="h100-sxm"):
        load_hardware("tpu-v9")
    with pytest.raises(ScheduleError, match="dtype"):
        load_hardware("a100-80gb").peak("int4")


def test_a_block_is_priced_from_its_flops_and_bytes() -> None:
    model = ModelSpec("m", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100)
    seq, b = 32, 2
    t = seq * b
    n = 4 * 64 * 64 + 3 * 64 * 256  # attention and gated FFN weights (the linears)
    assert model.layer_params() == n + 2 * 64  # and two norms
    (one,) = price_stages(model, TINY_GPU, stages=1, seq=seq, microbatch_size=b, efficiency=0.5)
    flop = 1e12 * 0.5
    attention = 2.0 * t * seq * 64
    # W is the linears' weight gradients only: 2 t n per block, plus the head's and
    # the embedding's scatter-add (memory bound).
    head_w = 2.0 * t * 100 * 64 / flop
    embed_w = t * 64 * 2 * 2 / (1e11 * 0.7)
    f, i, w = one.F, one.I, one.W
    assert w == pytest.approx(2 * 2.0 * t * n / flop + head_w + embed_w)
    # F and I carry the same matmul work plus attention and elementwise work; I more.
    assert f > 2 * (2.0 * t * n + attention) / flop
    assert i > f > w
    # Twice the microbatch, twice every figure.
    (two,) = price_stages(model, TINY_GPU, stages=1, seq=seq, microbatch_size=2 * b, efficiency=0.5)
    f2 = two.F
    assert f2 == pytest.approx(2 * f)
    assert two.act == pytest.approx(2 * one.act)


def test_unfused_attention_and_dropout_add_the_score_matrices_passes() -> None:
    model = ModelSpec("m", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100)
    seq, b = 32, 2
    t = seq * b
    scores = t * seq * 4  # elements of the four heads' score matrices
    flop, mem = 1e12 * 0.5, 1e11 * 0.7

    def stage(**run: Any) -> StagePrice:
        (one,) = price_stages(model, TINY_GPU, stages=1, seq=seq, microbatch_size=b,
                              efficiency=0.5, blocks=[2], **run)  # fmt: skip
        return one

    flash, unfused = stage(), stage(attention="unfused")
    both, flash_drop = stage(attention="unfused", dropout=True), stage(dropout=True)
    # Per block: the full square (4 t s d forward, 8 backward, against flash's 2 and 5),
    # the scores written, softmaxed and read forward (4 passes), 7 passes backward.
    square = t * seq * 64
    more_f, more_i = unfused.F - flash.F, unfused.I - flash.I
    assert more_f == pytest.approx(2 * (2 * square / flop + scores * 4 * 2 / mem))
    assert more_i == pytest.approx(2 * (3 * square / flop + scores * 7 * 2 / mem))
    assert unfused.act - flash.act == pytest.approx(2 * scores * 2)  # the probabilities kept
    # Dropout on the probabilities: two more passes each way and a one-byte mask; the
    # dropped copy and the mask are kept.  On the hidden states, two one-byte masks a block.
    dropout_f = both.F - unfused.F
    assert dropout_f == pytest.approx(2 * (scores * 5 + 2 * t * 64) / mem)
    assert both.act - unfused.act == pytest.approx(2 * (scores * 3 + 2 * t * 64))
    assert flash_drop.act - flash.act == pytest.approx(2 * 2 * t * 64)
    # None of it has weights: W and what W waits on are the same.
    for priced in (unfused, both, flash_drop):
        assert (priced.W, priced.act_w, priced.weights) == (flash.W, flash.act_w, flash.weights)
    with pytest.raises(ScheduleError, match="attention = 'sdpa'"):
        price_stages(model, TINY_GPU, stages=1, seq=seq, attention="sdpa")
    costs = costs_from_spec(model, TINY_GPU, stages=1, seq=seq, attention="unfused")
    assert costs.meta["attention"] == "unfused" and costs.stages[0].F > 0


def test_unfused_attention_with_dropout_keeps_the_published_activation_figure() -> None:
    # Korthikanti et al. 2022: s b h (34 + 5 a s / h) bytes per layer (GPT, ffn 4h, fp16,
    # dropout, the score matrices kept).
    model = ModelSpec(
        "gpt", layers=4, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=10, gated=False
    )
    seq = 512
    stages = price_stages(
        model, TINY_GPU, stages=4, seq=seq, blocks=[1] * 4, attention="unfused", dropout=True
    )
    figure = seq * 1024 * (34 + 5 * 16 * seq / 1024)
    assert stages[1].act == pytest.approx(figure, rel=0.05)


def test_activation_memory_is_near_the_published_transformer_figure() -> None:
    # Korthikanti et al. 2022: 34 s b h bytes per layer (GPT, ffn 4h, fp16) without the
    # attention scores a flash kernel does not keep; ours leaves out dropout masks.
    model = ModelSpec(
        "gpt", layers=4, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=10, gated=False
    )
    seq = 512
    stages = price_stages(model, TINY_GPU, stages=4, seq=seq, blocks=[1, 1, 1, 1])
    per_layer = stages[1].act
    assert per_layer == pytest.approx(34 * seq * 1024, rel=0.1)
    assert 0 < stages[1].act_w <= per_layer


def test_the_default_cut_gives_the_heavy_head_stage_fewer_blocks() -> None:
    costs = costs_from_spec("llama-3-8b", "h100-sxm", stages=4, seq=4096)
    blocks = costs.meta["blocks"]
    assert sum(blocks) == 32 and blocks[-1] < max(blocks)
    slowest = max(s.F + s.I + s.W for s in costs.stages)
    even = costs_from_spec("llama-3-8b", "h100-sxm", stages=4, seq=4096, blocks=[8] * 4)
    assert slowest < max(s.F + s.I + s.W for s in even.stages)
    with pytest.raises(ScheduleError, match="summing"):
        costs_from_spec("llama-3-8b", "h100-sxm", stages=4, seq=4096, blocks=[8, 8, 8])
    with pytest.raises(ScheduleError, match="at most layers"):
        costs_from_spec("llama-3-8b", "h100-sxm", stages=64, seq=4096)


def test_links_are_chosen_by_where_the_ranks_sit() -> None:
    gpu = load_hardware("a100-80gb")  # 8 per node
    inside = costs_from_spec("llama-2-7b", gpu, stages=4, seq=1024, dp=2)
    assert (inside.latency, inside.bandwidth) == (gpu.intra_latency, gpu.intra_bandwidth)
    assert inside.dp_bandwidth == gpu.intra_bandwidth
    across = costs_from_spec("llama-2-7b", gpu, stages=4, seq=1024, dp=4)
    assert across.bandwidth == gpu.inter_bandwidth and across.dp_bandwidth == gpu.intra_bandwidth
    wide = costs_from_spec("llama-2-7b", gpu, stages=4, seq=1024, dp=16)
    assert wide.dp_bandwidth == gpu.inter_bandwidth
    # A ring all-reduce: 2 (dp - 1) messages, 2 (dp - 1) / dp of the gradient each way.
    grad = wide.stages[1].reduced_bytes
    expected = 30 * gpu.inter_latency + 2 * 15 / 16 * grad / gpu.inter_bandwidth
    assert wide.reduce_time(1) == pytest.approx(expected)
    assert grad == pytest.approx(4 * 8 * load_model("llama-2-7b").layer_params())


def test_a_spec_model_simulates_and_round_trips_as_json() -> None:
    schedule = generate("1f1b", 4, 8)
    costs = costs_from_spec("llama-3-8b", "h100-sxm", stages=4, seq=2048, dp=2)
    again = CostModel.from_json(costs.to_json())
    assert again == costs and again.meta["flops_per_microbatch"] > 0
    timeline = simulate(schedule, costs=costs)
    work = sum(s.F + s.I + s.W for s in costs.stages)
    assert max(work, 0) < timeline.makespan * 4
    mfu = (
        costs.meta["flops_per_microbatch"] * 8 / (timeline.makespan * 4 * costs.meta["peak_flops"])
    )
    assert 0.1 < mfu < 0.6  # under the 0.6 efficiency: there is a bubble
    assert math.isfinite(max(timeline.peak_memory))


# -- tensor parallelism --------------------------------------------------------------------
GPT = ModelSpec("gpt", layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100, gated=False)


def _middle(hw: HardwareSpec, **run: Any) -> StagePrice:
    """The middle of three stages, holding both blocks: no embedding, no head."""
    return price_stages(GPT, hw, stages=3, seq=32, microbatch_size=2, blocks=[0, 2, 0], **run)[1]


def test_tensor_parallelism_cuts_a_blocks_work_and_adds_its_collectives() -> None:
    from dataclasses import replace

    from zeropipe.planning.pricing.tensor_parallel import TP_LINK_EFFICIENCY, matmul_share

    t, h, n = 64, 64, GPT.layer_params() - 2 * 64
    compute_only = replace(TINY_GPU, memory_bandwidth=math.inf)  # no memory-bound time
    one, two = _middle(compute_only), _middle(compute_only, tp=2)
    share = matmul_share(h, 2)
    assert share == pytest.approx((32 / 160) / (64 / 192))
    # Two all-reduces of the block's t x h activation forward, two in I, none in W: a ring
    # of 2 GPUs, 2 steps of half the bytes, at the link's efficiency.
    ring = 2 * TINY_GPU.intra_latency + t * h * 2 / (TINY_GPU.intra_bandwidth * TP_LINK_EFFICIENCY)
    f2, i2, w2 = two.F, two.I, two.W
    assert w2 == pytest.approx(one.W / (2 * share))
    assert f2 == pytest.approx(one.F / (2 * share) + 2 * 2 * ring)
    assert i2 == pytest.approx(one.I / (2 * share) + 2 * 2 * ring)
    assert f2 == two.R  # a recomputed forward repeats its collectives
    # One GPU's weights: half of every linear, the norms whole.
    assert two.params == 2 * (n // 2 + 2 * h) and one.params == 2 * (n + 2 * h)
    assert two.weights == two.params * 18 and two.grad_bytes == two.params * 4
    assert two.boundary_bytes == one.boundary_bytes / 2


def test_sequence_parallelism_decides_what_activations_tp_divides() -> None:
    one = _middle(TINY_GPU, dropout=True)
    sp = _middle(TINY_GPU, tp=2, dropout=True)
    plain = _middle(TINY_GPU, tp=2, dropout=True, sequence_parallel=False)
    # With sequence parallelism every activation is cut; without, the norms' inputs and
    # outputs (4 h) and the dropout masks (2 one-byte h) outside the region are whole.
    assert sp.act == pytest.approx(one.act / 2)
    outside = 2 * 64 * (4 * 64 * 2 + 2 * 64)  # two blocks of t = 64 tokens
    assert plain.act == pytest.approx(one.act / 2 + outside / 2)
    assert sp.ckpt == one.ckpt / 2 and plain.ckpt == one.ckpt
    assert sp.act_w <= sp.act and plain.act_w <= plain.act
    assert plain.F > sp.F  # the memory-bound work outside the region is whole too
    assert plain.weights == sp.weights and plain.W == sp.W


def test_tp_the_model_or_node_cannot_take_is_refused_naming_the_fix() -> None:
    with pytest.raises(ScheduleError, match="tp 3 does not divide the 4 GPUs of a node"):
        price_stages(GPT, TINY_GPU, stages=1, seq=32, tp=3)
    with pytest.raises(ScheduleError, match=r"must divide the attention heads \(4\)"):
        price_stages(GPT, TINY_GPU, stages=1, seq=32, tp=8, tp_across_nodes=True)
    odd = ModelSpec("odd", layers=2, hidden=96, heads=6, kv_heads=3, ffn=192, vocab=10)
    with pytest.raises(ScheduleError, match="key/value heads"):
        price_stages(odd, TINY_GPU, stages=1, seq=32, tp=2)
    with pytest.raises(ScheduleError, match="tp = 0"):
        costs_from_spec(GPT, TINY_GPU, stages=1, seq=32, tp=0)


def test_key_value_heads_fewer_than_tp_are_copied() -> None:
    gqa = ModelSpec("gqa", layers=2, hidden=64, heads=8, kv_heads=2, ffn=128, vocab=10)
    (four,) = price_stages(gqa, TINY_GPU, stages=1, seq=8, tp=4, blocks=[2])
    (one,) = price_stages(gqa, TINY_GPU, stages=1, seq=8, blocks=[2])
    h, d, kv = 64, 64, gqa.kv_dim
    # Per GPU: a quarter of q, the output projection and the FFN, but one whole k and v
    # head (kv / 2 wide): the two kv heads cannot be cut four ways.
    block = h * d // 4 + 2 * h * kv // 2 + d * h // 4 + 3 * h * 128 // 4 + 2 * h
    head_and_embedding = 2 * 10 * h // 4 + h
    assert four.params == 2 * block + head_and_embedding
    assert four.params > one.params / 4


def test_tp_across_nodes_runs_its_collectives_on_the_network() -> None:
    from dataclasses import replace

    compute_only = replace(TINY_GPU, memory_bandwidth=math.inf)
    inside = _middle(compute_only, tp=4)
    across = _middle(compute_only, tp=4, tp_across_nodes=True)
    assert across == inside  # 4 GPUs fit the node: the flag only allows more
    wide = _middle(compute_only, tp=4, tp_across_nodes=True)
    wide8 = price_stages(
        ModelSpec("g", layers=2, hidden=64, heads=8, kv_heads=8, ffn=256, vocab=100),
        compute_only, stages=3, seq=32, microbatch_size=2, blocks=[0, 2, 0], tp=8,
        tp_across_nodes=True,
    )[1]  # fmt: skip
    # 8 GPUs on 4-GPU nodes: the ring's steps go at the network's 1e9, not the node's 1e10.
    assert wide8.F - wide8.W > 5 * (wide.F - wide.W)


def test_ranks_are_laid_out_tp_innermost() -> None:
    from zeropipe.planning.pricing.links import pipeline_crosses_nodes, replicas_cross_nodes

    assert not pipeline_crosses_nodes(2, 1, 8, tp=4) and pipeline_crosses_nodes(2, 1, 8, tp=8)
    assert not replicas_cross_nodes(2, 8, tp=4) and replicas_cross_nodes(2, 8, tp=8)
    assert replicas_cross_nodes(3, 8, tp=2)  # 6 of 8: the next group straddles two nodes
    gpu = load_hardware("a100-80gb")
    costs = costs_from_spec("llama-2-7b", gpu, stages=2, seq=1024, dp=2, tp=4)
    assert costs.bandwidth == gpu.inter_bandwidth and costs.dp_bandwidth == gpu.intra_bandwidth
    assert costs.meta["tp"] == 4 and costs.meta["sequence_parallel"] is True
    plain = costs_from_spec("llama-2-7b", gpu, stages=2, seq=1024, dp=2)
    off = costs_from_spec("llama-2-7b", gpu, stages=2, seq=1024, dp=2, sequence_parallel=False)
    assert plain == off and plain.meta["sequence_parallel"] is False  # tp 1: nothing to cut


def test_blocks_checkpointed_one_by_one_keep_their_inputs_and_rebuild_one_at_a_time() -> None:
    # torchtitan's full activation checkpointing: each block keeps its input, its forward
    # runs again before its backward, and only that block's activations are held meanwhile.
    model = ModelSpec("m", layers=4, hidden=64, heads=4, kv_heads=4, ffn=256, vocab=100)
    args: dict[str, Any] = {"stages": 2, "seq": 32, "microbatch_size": 2, "blocks": [2, 2]}
    plain = price_stages(model, TINY_GPU, **args)
    ac = price_stages(model, TINY_GPU, **args, checkpoint_blocks=True)
    block = plain[0].act / 2  # the first stage: two blocks and the embedding, which keeps none
    block_input = 64 * 32 * 2 * 2.0  # hidden x tokens x bf16
    head = plain[1].act - block * 2
    for p, c in zip(plain, ac, strict=True):
        assert (c.F, c.W, c.R) == (p.F, p.W, p.R) and c.act_w == p.act_w
        assert c.workspace == pytest.approx(block) and p.workspace == 0.0
    # The first stage's I gains its two blocks' forward (the embedding is not recomputed).
    embedding_f = 32 * 2 * 64 * 2 / (1e11 * 0.7)  # its lookup, the embedding's F
    gained = ac[0].I - plain[0].I
    assert gained == pytest.approx(plain[0].F - embedding_f)
    assert ac[0].act == pytest.approx(2 * block_input)
    assert ac[1].act == pytest.approx(2 * block_input + head)  # the head keeps its own
    # In a simulated step: a stage of one microbatch held whole, against its inputs and
    # one block rebuilt.
    kept = costs_from_spec(model, TINY_GPU, stages=1, seq=32, microbatch_size=2)
    rebuilt = costs_from_spec(
        model, TINY_GPU, stages=1, seq=32, microbatch_size=2, checkpoint_blocks=True
    )
    schedule = generate("1f1b", 1, 1)
    weights = kept.stages[0].weights
    assert max(simulate(schedule, kept).peak_memory) == pytest.approx(weights + 4 * block + head)
    assert max(simulate(schedule, rebuilt).peak_memory) == pytest.approx(
        weights + 4 * block_input + head + block
    )
    assert rebuilt.meta["checkpoint_blocks"] is True and "checkpoint_blocks" not in kept.meta


def test_checkpointed_mixture_of_experts_blocks_run_their_all_to_alls_again_in_i() -> None:
    # The rebuilt forward dispatches and combines its tokens again: I's all-to-all share (what
    # an overlapped pair can hide) gains the forward's.
    model, gpu = load_model("qwen3-30b-a3b"), load_hardware("h100-sxm")
    plain = price_stages(model, gpu, stages=2, seq=4096, ep=8)
    ac = price_stages(model, gpu, stages=2, seq=4096, ep=8, checkpoint_blocks=True)
    for p, c in zip(plain, ac, strict=True):
        assert p.all_to_all_f > 0 and c.all_to_all_f == p.all_to_all_f
        assert c.all_to_all_i == pytest.approx(p.all_to_all_i + p.all_to_all_f)
