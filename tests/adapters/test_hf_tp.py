"""``zeropipe.parallelize``: HF models tensor-parallel inside a pipeline, exactly the model's own.

The gradient checks are one 4-process gloo launch (tests/adapters/tp_cases.py: tp 2
inside pp 2, Llama, Qwen2 and Qwen3 under 1f1b and zbv, with and without sequence
parallelism, both orders of split and parallelize; Qwen3-MoE, Mixtral and DeepSeek-V3,
and Qwen3-MoE with its experts sharded over 2 replicas; Llama over microbatches of different
lengths), compared here with the unsplit,
unparallel model in float64 to 1e-10.  The refusals that need no processes run here.
"""

from __future__ import annotations

import functools
import math
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

import zeropipe
from tests.adapters import hf_cases, tp_cases
from tests.gradcheck import no_crash
from zeropipe.core.errors import PipelineError

TOL = 1e-10
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


@functools.cache
def _reference(arch: str, tied: bool) -> list[tuple[float, dict[str, Tensor]]]:
    return tp_cases.reference(arch, tied)


def _case_results(key: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    results = tp_cases.results()
    out = []
    for r in results:
        got = r["cases"][key]
        no_crash(got, f"{key} on pp rank {r['pp']}, tp rank {r['tp']}")
        out.append((r, got))
    return out


@pytest.mark.parametrize("key", sorted(tp_cases.CASES))
def test_tensor_parallel_pipeline_gives_the_models_own_loss_and_gradients(key: str) -> None:
    arch, tied, *_ = tp_cases.CASES[key]
    refs = _reference(arch, tied)
    names = set(dict(tp_cases.build(arch, tied).named_parameters()))
    ranks = _case_results(key)
    for step, (ref_loss, ref_grads) in enumerate(refs):
        seen: set[str] = set()
        for r, got in ranks:
            where = f"{key} step {step} on pp {r['pp']} tp {r['tp']}"
            mine = got["steps"][step]
            assert abs(mine["loss"] - ref_loss) <= TOL, (where, mine["loss"], ref_loss)
            for name, g in mine["grads"].items():
                diff = (g - ref_grads[name]).abs().max().item()
                assert diff <= TOL, f"{where}: {name} differs by {diff:.3g}"
            seen |= set(mine["grads"])
            # the gradients compared were computed tensor-parallel: sharded ones are DTensors
            sharded = {n for n in mine["grads"] if got["layouts"][n] != "plain"}
            assert sharded and set(mine["dtensor_grads"]) == sharded, (where, sharded)
        assert seen == names, f"{key} step {step}: no gradient for {sorted(names - seen)}"


@pytest.mark.parametrize("key", sorted(tp_cases.CASES))
def test_the_plan_shards_projections_and_keeps_embedding_and_head_whole(key: str) -> None:
    arch, _tied, _schedule, _order, sp = tp_cases.CASES[key]
    for _r, got in _case_results(key):
        layouts, local = got["layouts"], got["local_shapes"]
        for name, placement in layouts.items():
            leaf = name.split(".")[-2]
            if leaf in COLWISE and name.endswith(".weight"):
                assert placement == "Shard(0)", (key, name, placement)
                assert local[name][0] * tp_cases.TP in (32, 16, 48), (key, name, local[name])
            elif leaf in COLWISE:  # Qwen2's q/k/v biases
                assert placement == "Shard(0)", (key, name, placement)
            elif leaf in ROWWISE:
                assert placement == "Shard(1)", (key, name, placement)
                assert local[name][1] * tp_cases.TP in (32, 48), (key, name, local[name])
            elif leaf in ("q_norm", "k_norm") or (sp and leaf.endswith("_layernorm")):
                assert placement == "Replicate", (key, name, placement)
            else:  # embedding, final norm, head; the layer norms without sequence parallelism
                assert placement == "plain", (key, name, placement)
        sharded = [n for n, pl in layouts.items() if pl.startswith("Shard")]
        per_layer = 7 + (3 if arch == "qwen2" else 0)
        assert len(sharded) == 4 * per_layer, (key, sharded)


# -- mixtures of experts -----------------------------------------------------------------
EP_KEYS = (tp_cases.EP_CASE, tp_cases.EP_THEN_TP)
MOE_KEYS = [*sorted(tp_cases.MOE_CASES), *EP_KEYS]


def _moe(key: str) -> tuple[str, int]:
    """A mixture case's architecture and replicas."""
    if key in EP_KEYS:
        return "qwen3_moe", tp_cases.EP_DP
    return tp_cases.MOE_CASES[key][0], 1


@functools.cache
def _moe_reference(arch: str, replicas: int) -> list[tuple[float, dict[str, Tensor]]]:
    return tp_cases.moe_reference(arch, replicas)


def _diff(got: Tensor, want: Tensor) -> float:
    """The largest difference, float32 ones (DeepSeek-V3's router) scaled to float32's
    precision as hf_moe_cases.step_errors does."""
    scale = 1.0 if want.dtype == torch.float64 else 1e-5
    return (got - want).abs().max().item() * scale


@pytest.mark.parametrize("key", MOE_KEYS)
def test_a_tensor_parallel_mixture_gives_the_models_own_loss_gradients_and_norm(
    key: str,
) -> None:
    """Attention by heads over "tp", the router and experts replicated (sharded over the
    replicas with ep): the loss with the router's term, every gradient, and the gradient
    norm clip_grad_norm_ takes (nothing counted once per tp rank) are the unsplit model's."""
    arch, replicas = _moe(key)
    refs = _moe_reference(arch, replicas)
    names = set(dict(tp_cases.moe_build(arch).named_parameters()))
    ranks = _case_results(key)
    for step, (ref_loss, ref_grads) in enumerate(refs):
        norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref_grads.values()))
        seen: set[str] = set()
        for r, got in ranks:
            where = f"{key} step {step} on pp {r['pp']} tp {r['tp']}"
            mine = got["steps"][step]
            assert abs(mine["loss"] - ref_loss) <= TOL, (where, mine["loss"], ref_loss)
            assert abs(mine["norm"] - norm) <= TOL * norm, (where, mine["norm"], norm)
            for name, g in mine["grads"].items():
                diff = _diff(g, ref_grads[name])
                assert diff <= TOL, f"{where}: {name} differs by {diff:.3g}"
            seen |= set(mine["grads"])
            sharded = {n for n in mine["grads"] if got["layouts"][n] != "plain"}
            assert sharded and set(mine["dtensor_grads"]) == sharded, (where, sharded)
        assert seen == names, f"{key} step {step}: no gradient for {sorted(names - seen)}"


@pytest.mark.parametrize("key", MOE_KEYS)
def test_a_mixtures_attention_and_dense_mlps_are_sharded_and_its_sparse_blocks_replicated(
    key: str,
) -> None:
    heads = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
    for _r, got in _case_results(key):
        layouts, local = got["layouts"], got["local_shapes"]
        for name, placement in layouts.items():
            leaf = name.split(".")[-2]
            if leaf in heads:
                assert placement == "Shard(0)", (key, name, placement)
            elif leaf in ROWWISE:  # o_proj; a dense MLP's or DeepSeek's shared experts' down
                assert placement == "Shard(1)", (key, name, placement)
            elif leaf in ("q_norm", "k_norm"):
                assert placement == "Replicate", (key, name, placement)
            elif leaf == "experts" and key in EP_KEYS:  # 4 experts over 2 replicas
                assert placement == "Shard(0)" and local[name][0] == 2, (key, name, local)
            else:  # router, experts, MLA's latent projections and norms, embedding, head
                assert placement == "plain", (key, name, placement)
        routers = [n for n in layouts if n.endswith("mlp.gate.weight")]
        assert routers and all(layouts[n] == "plain" for n in routers), (key, routers)


def test_sequence_parallelism_on_a_mixture_is_refused_before_anything_changes() -> None:
    for arch, cls, what in (
        ("qwen3_moe", "Qwen3MoeDecoderLayer", "a mixture of experts"),
        ("mixtral", "MixtralDecoderLayer", "a mixture of experts"),
        ("deepseek_v3", "DeepseekV3DecoderLayer", r"latent attention \(MLA\)"),
    ):
        model = tp_cases.moe_build(arch)
        with pytest.raises(PipelineError, match=f"sequence_parallel=True\\): {cls} holds {what}"):
            zeropipe.parallelize(model, _fake_mesh(), sequence_parallel=True)
        assert _plain(model)


def test_microbatches_of_different_lengths_through_tensor_parallel_stages() -> None:
    # zbv at pp 2 x tp 2 over zeropipe.Microbatches of 8, 12 and 4 tokens
    ref_loss, ref_grads = tp_cases.varlen_reference()
    seen: set[str] = set()
    for r in tp_cases.results():
        got = r["microbatches"]
        no_crash(got, f"microbatches on pp {r['pp']} tp {r['tp']}")
        assert abs(got["loss"] - ref_loss) <= TOL, (r["pp"], r["tp"], got["loss"], ref_loss)
        for name, g in got["grads"].items():
            diff = (g - ref_grads[name]).abs().max().item()
            assert diff <= TOL, f"pp {r['pp']} tp {r['tp']}: {name} differs by {diff:.3g}"
        seen |= set(got["grads"])
    assert seen == set(ref_grads)


def test_refusals_inside_the_launch() -> None:
    for r in tp_cases.results():
        no_crash(r["refusals"], f"refusals on pp {r['pp']} tp {r['tp']}")
        two_d, kv, twice, odd = r["refusals"]
        assert "must be a 1-D DeviceMesh, got a 2-D mesh (dims 'pp', 'tp')" in two_d
        assert "mesh['tp']" in two_d
        assert "4 attention heads and 1 key/value heads" in kv and "2 'tp' ranks" in kv
        assert "Qwen3DecoderLayer already holds DTensor parameters" in twice
        assert "a decoder layer got 5 positions, which the 2 'tp' ranks" in odd


# -- refusals in one process -------------------------------------------------------------
def _fake_mesh(ndim: int = 1, size: int = 2) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = mock.MagicMock(spec=DeviceMesh)
    mesh.ndim = ndim
    mesh.size.return_value = size
    mesh.mesh_dim_names = ("pp", "tp")[:ndim] if ndim <= 2 else None
    return mesh


def _plain(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return not any(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize(
    ("heads", "kv", "size", "says"),
    [
        (4, 1, 2, "4 attention heads and 1 key/value heads"),
        (6, 2, 4, "6 attention heads and 2 key/value heads"),
        (4, 4, 8, "4 attention heads and 4 key/value heads"),
    ],
)
def test_heads_not_divisible_by_tp_are_refused_before_anything_changes(
    heads: int, kv: int, size: int, says: str
) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=16, hidden_size=heads * 4, intermediate_size=8,
                               num_hidden_layers=1, num_attention_heads=heads,
                               num_key_value_heads=kv, head_dim=4)  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    mesh = _fake_mesh(size=size)
    with pytest.raises(PipelineError, match=f"{says}.*{size} 'tp' ranks.*use a tp size"):
        zeropipe.parallelize(model, mesh)
    with pytest.raises(PipelineError, match=says):
        zeropipe.parallelize(zeropipe.split(model, 2, balance=[1, 0]), mesh)
    assert _plain(model)


def test_unsupported_families_are_refused_naming_the_supported_ones() -> None:
    supported = "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    gpt2 = hf_cases.build("gpt2", tied=False)
    with pytest.raises(PipelineError, match=f"the Hugging Face model GPT2LMHeadModel.*{supported}"):
        zeropipe.parallelize(gpt2, _fake_mesh())
    with pytest.raises(PipelineError, match=f"GPT2Block.*{supported}"):
        zeropipe.parallelize(zeropipe.split(gpt2, 2, balance=[2, 2]), _fake_mesh())
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(PipelineError, match=f"Sequential.*{supported}"):
        zeropipe.parallelize(seq, _fake_mesh())
    with pytest.raises(PipelineError, match=f"Linear.*{supported}"):
        zeropipe.parallelize(list(seq), _fake_mesh())
    with pytest.raises(PipelineError, match="takes a Hugging Face causal LM or the list"):
        zeropipe.parallelize([], _fake_mesh())
    assert _plain(gpt2)


@pytest.mark.parametrize(
    ("mesh", "says"),
    [
        (None, "must be a 1-D DeviceMesh .*got NoneType"),
        ("tp", "must be a 1-D DeviceMesh .*got str"),
        (_fake_mesh(ndim=2), r"got a 2-D mesh \(dims 'pp', 'tp'\); pass its 'tp' dimension"),
    ],
    ids=["none", "str", "2-D"],
)
def test_a_tp_mesh_that_is_not_one_dimensional_is_refused(mesh: Any, says: str) -> None:
    model = tp_cases.build("qwen3", tied=False)
    with pytest.raises(PipelineError, match=says):
        zeropipe.parallelize(model, mesh)
    assert _plain(model)


def test_parallelize_is_public_and_lazy() -> None:
    assert "parallelize" in zeropipe.__all__
    assert zeropipe.parallelize.__module__ == "zeropipe.adapters.tp"
