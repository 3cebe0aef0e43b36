"""Expert parallelism (``zeropipe.parallelize(..., ep_mesh=)``): the unsharded model's loss and
gradients, exactly, in float64 on gloo.

Two launches (tests/adapters/ep_cases.py): 2 processes at ep 2 without a pipeline
(Qwen3-MoE, Mixtral, DeepSeek-V3; a routing that leaves one rank without rows), and
4 processes at pp 2 x dp 2 with the experts sharded over "dp" (1f1b, zbv, recompute,
clip_grad_norm_, a DCP checkpoint saved at ep 2 and loaded at ep 1; dualpipev with its
overlapped pairs of expert stages run at once, against the same pairs in sequence;
dp_shard=True, the experts left out of FSDP2).  The checkpoint is
also loaded here, in one process.  Refusals that need no processes run here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install -e '.[hf]'"
)

import torch

import zeropipe
from tests.adapters import ep_cases, hf_cases, hf_moe_cases
from tests.gradcheck import no_crash
from zeropipe.core.errors import PipelineError

TOL = 1e-12  # float64: only the order of a few sums differs from the eager forward
EXPERT_PARAMS = {"qwen3_moe": 6, "mixtral": 8, "deepseek_v3": 6}  # two per MoE layer


def _got(results: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    for i, r in enumerate(results):
        no_crash(r[key], f"{key} on process {i}")
    return [r[key] for r in results]


@pytest.mark.parametrize("arch", ep_cases.ARCHS)
def test_ep2_gives_the_whole_batch_loss_and_gradients(arch: str) -> None:
    for rank, got in enumerate(_got(ep_cases.two_process_results(), arch)):
        assert got["loss"] <= TOL and got["grad"] <= TOL, (arch, rank, got)
        assert got["checked"] == got["names"], (arch, rank, got)
        # the experts were sharded: each rank holds 2 of the 4, as a DTensor Shard(0)
        assert len(got["sharded"]) == EXPERT_PARAMS[arch], got["sharded"]
        for shape, placement in got["sharded"].values():
            assert shape[0] == ep_cases.EXPERTS // 2 and placement == "S(0)", got["sharded"]


def test_a_rank_that_receives_no_rows_still_gives_the_eager_result() -> None:
    for rank, got in enumerate(_got(ep_cases.two_process_results(), "one-sided")):
        assert max(got["output"], got["input"], got["grad"]) <= TOL, (rank, got)
        assert set(got["sharded"]) == {"gate_up_proj", "down_proj"}, got


def test_experts_sharded_twice_are_refused() -> None:
    for said in _got(ep_cases.two_process_results(), "twice"):
        assert "MixtralExperts is sharded over 'ep' already" in said, said


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    path = tmp_path_factory.mktemp("ep") / "ckpt"
    return ep_cases.four_process_results(str(path)), path


@pytest.mark.parametrize("schedule", ["1f1b", "zbv", "1f1b+recompute"])
def test_ep_inside_dp_pipeline_gives_the_reference(
    pipeline_run: tuple[list[dict[str, Any]], Path], schedule: str
) -> None:
    results, _ = pipeline_run
    names = set(dict(hf_moe_cases.build("qwen3_moe").named_parameters()))
    for r, got in zip(results, _got(results, schedule), strict=True):
        where = f"{schedule} on pp {r['pp']} dp {r['dp']}"
        assert got["loss"] <= TOL and got["grad"] <= TOL, (where, got)
        assert got["norm"] <= TOL, (where, got)  # clip_grad_norm_'s total, relative
        assert got["sharded"], where  # this rank's stages hold sharded experts
    # the two pipeline ranks of a replica compare every parameter between them
    per_pp = {r["pp"]: r[schedule]["checked"] for r in results if r["dp"] == 0}
    assert sum(per_pp.values()) == len(names), per_pp


def test_dualpipev_pairs_of_expert_stages_run_at_once_with_the_gradients_of_pairs_in_sequence(
    pipeline_run: tuple[list[dict[str, Any]], Path],
) -> None:
    # The forward's all-to-alls go on one group, the backward's on another: a pair whose
    # two stages both exchange rows runs its halves at once, and every rank's loss and
    # gradients are bitwise those of the pairs run one half after the other.
    results, _ = pipeline_run
    for r, got in zip(results, _got(results, "dualpipev overlap"), strict=True):
        where = f"pp {r['pp']} dp {r['dp']}"
        assert got["equal"], where
        assert got["loss"] <= TOL and got["grad"] <= TOL and got["sharded"], (where, got)
        assert len(got["pairs"]) == 7, (where, got["pairs"])
        # pipeline rank 0 holds stages 0 and 3, each with experts: every pair of it is
        # the case in point, and its two spans overlap in time (rank 1's stage 1 is the
        # dense layer, whose short forward may end before the worker's backward starts)
        assert all(both for _, both in got["pairs"]) == (r["pp"] == 0), (where, got["pairs"])
        if r["pp"] == 0:
            assert min(shared for shared, _ in got["pairs"]) > 0, (where, got["pairs"])


def test_ep_smaller_than_dp_sums_experts_over_the_replicas_holding_them(
    pipeline_run: tuple[list[dict[str, Any]], Path],
) -> None:
    for rank, got in enumerate(_got(pipeline_run[0], "ep2 dp4")):
        assert got["loss"] <= TOL and got["grad"] <= TOL and got["norm"] <= TOL, (rank, got)
        assert got["checked"] == got["names"] and len(got["sharded"]) == 6, (rank, got)


def test_dp_shard_with_experts_inside_dp_gives_the_reference(
    pipeline_run: tuple[list[dict[str, Any]], Path],
) -> None:
    # FSDP2 shards every parameter over "dp" but the experts, which stay whole on their ep
    # rank: gathered whole, the gradients and clip_grad_norm_'s total are the reference's.
    results, _ = pipeline_run
    names = set(dict(hf_moe_cases.build("qwen3_moe").named_parameters()))
    for r, got in zip(results, _got(results, "1f1b dp_shard"), strict=True):
        where = f"pp {r['pp']} dp {r['dp']}"
        assert got["loss"] <= TOL and got["grad"] <= TOL and got["norm"] <= TOL, (where, got)
        assert got["fsdp"] > 0 and got["sharded"], (where, got)
        for shape, placement in got["sharded"].values():
            assert shape[0] == ep_cases.EXPERTS // 2 and placement == "S(0)", (where, got)
        assert got["fsdp"] + len(got["sharded"]) == got["checked"], (where, got)
    per_pp = {r["pp"]: r["1f1b dp_shard"]["checked"] for r in results if r["dp"] == 0}
    assert sum(per_pp.values()) == len(names), per_pp
    # ep 2 < dp 4: FSDP2 shards the experts again over the 2 replicas holding them (the
    # "rep" dimension of their mesh: one expert a rank); on an ep mesh made alone they stay
    # whole (two a rank), summed over those replicas
    for key, experts, placement in (
        ("ep2 dp4 dp_shard", 1, "_S(0, 2)"),
        ("ep2 dp4 dp_shard own mesh", 2, "S(0)"),
    ):
        for rank, got in enumerate(_got(results, key)):
            assert got["loss"] <= TOL and got["grad"] <= TOL and got["norm"] <= TOL, (rank, got)
            assert got["checked"] == got["names"] and len(got["sharded"]) == 6, (rank, got)
            assert got["fsdp"] + 6 == got["checked"], (rank, got)
            for shape, held in got["sharded"].values():
                assert (shape[0], held) == (experts, placement), (key, rank, got["sharded"])


def test_a_checkpoint_saved_at_ep2_loads_at_ep1_and_in_one_process(
    pipeline_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, path = pipeline_run
    for got in _got(results, "load ep1"):
        assert got["value"] == 0.0 and got["checked"] > 0 and got["experts"] > 0, got
    model = hf_moe_cases.build("qwen3_moe")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    pipe = zeropipe.Pipeline(
        hf_moe_cases.cut(model, 1), "1f1b", loss_fn=zeropipe.causal_lm_loss,
        microbatches=hf_moe_cases.M, mesh="local",
    )  # fmt: skip
    zeropipe.load_checkpoint(pipe, None, path, model=model)
    want = dict(hf_moe_cases.build("qwen3_moe").named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
    ids, labels = hf_cases.batch(0, 8)
    assert torch.isfinite(pipe.step(ids, labels))


# -- refusals in one process -------------------------------------------------------------
def _fake_mesh(ndim: int = 1, size: int = 2) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    mesh = mock.MagicMock(spec=DeviceMesh)
    mesh.ndim = ndim
    mesh.size.return_value = size
    return mesh


def _plain(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return not any(isinstance(p, DTensor) for p in model.parameters())


def test_other_expert_layouts_are_refused() -> None:
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = AutoConfig.for_model("gpt_oss", hidden_size=8, intermediate_size=8, num_local_experts=4,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                               num_hidden_layers=1, vocab_size=16)  # fmt: skip
    experts = GptOssExperts(cfg)
    with pytest.raises(PipelineError, match=r"GptOssExperts has an expert layout.*has_bias"):
        zeropipe.parallelize(torch.nn.Sequential(experts), ep_mesh=_fake_mesh())
    assert _plain(experts)


def test_an_expert_count_the_group_does_not_divide_is_refused() -> None:
    model = hf_moe_cases.build("mixtral", aux=False)
    with pytest.raises(PipelineError, match=r"MixtralExperts has 4 experts.*3 'ep' ranks.*1, 2, 4"):
        zeropipe.parallelize(model, ep_mesh=_fake_mesh(size=3))
    assert _plain(model)


def test_a_model_without_experts_and_a_mesh_not_1d_are_refused() -> None:
    llama = hf_cases.build("llama", tied=False)
    with pytest.raises(PipelineError, match="holds no mixture-of-experts layer"):
        zeropipe.parallelize(llama, ep_mesh=_fake_mesh())
    model = hf_moe_cases.build("qwen3_moe", aux=False)
    with pytest.raises(PipelineError, match=r"ep_mesh must be a 1-D DeviceMesh.*got a 2-D mesh"):
        zeropipe.parallelize(model, ep_mesh=_fake_mesh(ndim=2))
    with pytest.raises(PipelineError, match=r"ep_mesh must be a 1-D DeviceMesh.*got str"):
        zeropipe.parallelize(model, ep_mesh="ep")
    assert _plain(model)
