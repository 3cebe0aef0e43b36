"""DCP checkpoints of a tensor-parallel pipeline: saved at pp 2 x tp 2, resumed exactly at
pp 2 x tp 1, at pp 1 x tp 2 and in one process, the AdamW moments resharded with the weights.

Two launches (tests/runtime/tp_ckpt_cases.py): 4 processes train the float64 GPT at
pp 2 x tp 2, save after 2 steps and go on for 3 (the uninterrupted losses); 2 processes
load that checkpoint at each of the other layouts and run the same 3 steps.  The test
process compares them with the plain model trained in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from tests.runtime import tp_ckpt_cases as cases
from zeropipe.runtime.checkpoint.dcp import consolidated_state_dict, load_checkpoint
from zeropipe.runtime.checkpoint.folder import verify_checkpoint
from zeropipe.runtime.launch import launch

BEFORE, AFTER = cases.STEPS_BEFORE, cases.STEPS_AFTER
# The Megatron layout of the GPT's blocks: what parallelize_gpt makes DTensors.
SHARDED = ("q", "k", "v", "proj"), ("up", "down")


def test_saved_at_pp2_tp2_resumes_at_pp2_tp1_pp1_tp2_and_in_one_process(tmp_path: Path) -> None:
    plain, plain_opt = cases.pipeline(1, 1)
    expected = cases.run(plain, plain_opt, range(BEFORE + AFTER))
    path = str(tmp_path / "ckpt")
    saved = launch(cases.save_and_go_on, 4, path, timeout=300, threads=1)
    # pp 2 x tp 2: the plain model's losses before and after the save
    for out in saved:
        assert out["before"] == pytest.approx(expected[:BEFORE], abs=1e-12, rel=0)
        assert out["after"] == pytest.approx(expected[BEFORE:], abs=1e-12, rel=0)
    # rank = pp * 2 + tp: pipeline rank 0 (ranks 0, 1) holds block 1's layers 1 and 2
    want = {f"{i}.{n}.{w}" for i, ns in ((1, SHARDED[0]), (2, SHARDED[1])) for n in ns
            for w in ("weight", "bias")}  # fmt: skip
    assert set(saved[0]["sharded"]) == set(saved[1]["sharded"]) == want

    manifest = verify_checkpoint(path)
    assert sorted(manifest["files"]) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    # Global shapes, written as the two tensor-parallel shards (rows for q, columns for proj)
    for key, size, offsets in (
        ("model.1.q.weight", [16, 16], [[0, 0], [8, 0]]),
        ("model.1.proj.weight", [16, 16], [[0, 0], [0, 8]]),
        ("optim.2.up.weight.exp_avg", [64, 16], [[0, 0], [32, 0]]),
        ("optim.4.down.weight.exp_avg_sq", [16, 64], [[0, 0], [0, 32]]),
    ):
        entry = md[key]
        assert list(entry.size) == size, key  # type: ignore[union-attr]
        got = sorted(list(c.offsets) for c in entry.chunks)  # type: ignore[union-attr]
        assert got == offsets, key
    assert len(md["model.1.ln1.weight"].chunks) == 1  # type: ignore[union-attr]  # replicated

    scratch = str(tmp_path / "nan")
    resumed = launch(cases.resume_both, 2, path, scratch, timeout=300, threads=1)
    worst = 0.0
    for rank, out in enumerate(resumed):
        for layout in ("pp2 tp1", "pp1 tp2"):
            assert out[f"extra {layout}"] == {"step": BEFORE}, (rank, layout)
            got = out[layout]
            worst = max(worst, *(abs(a - b) for a, b in zip(got, saved[0]["after"], strict=True)))
            assert got == pytest.approx(saved[0]["after"], abs=1e-10, rel=0), (rank, layout)
        # A NaN in rank 1's shard only: both ranks refuse, naming the weight.
        assert "holds non-finite values in '1.q.weight'" in out["nan"], (rank, out["nan"])
        assert "[32, 16], the model has torch.float64 [32, 24]" in out["wider"], out["wider"]
    assert worst <= 1e-10

    # tp 2 -> tp 1 with no process group at all: one process loads every shard
    local, opt = cases.pipeline(1, 1)
    assert load_checkpoint(local, opt, path) == {"step": BEFORE}
    after = cases.run(local, opt, range(BEFORE, BEFORE + AFTER))
    assert after == pytest.approx(saved[0]["after"], abs=1e-10, rel=0)
    assert after != pytest.approx(expected[:AFTER], abs=1e-3)  # the steps did move
    tensors, aliases = consolidated_state_dict(path)
    assert tuple(tensors["2.up.weight"].shape) == (64, 16)
    assert aliases == {"5.out.weight": "0.token.weight"}  # the tied head, stored once
