"""DCP checkpoints of a Pipeline: saved on one layout, resumed exactly on another; keyed by
the model's names; never half-written; refusals name the key or the file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from tests.gradcheck import batch_for, token_loss, token_model
from zeropipe import build_schedule
from zeropipe.runtime.checkpoint.dcp import (
    consolidated_state_dict,
    load_checkpoint,
    save_checkpoint,
    state_names,
)
from zeropipe.runtime.checkpoint.folder import MANIFEST, CheckpointError, verify_checkpoint
from zeropipe.runtime.launch import launch
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

SAVED_AT, STEPS, M = 3, 6, 4
OPTIONS = RuntimeOptions(timeout=30.0)


def _model() -> nn.Sequential:
    # float64, head tied to the embedding; dropout: a resume must restore what seeds it
    return token_model(layers=8, dropout=0.2)


def _batch(step: int) -> tuple[Tensor, Tensor]:
    return batch_for(_model(), batch=8, seq=3, seed=100 + step)


def _run(pipe: Pipeline, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = pipe.step(*_batch(step))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _pipe(schedule: str, ranks: int, **kw: Any) -> tuple[Pipeline, torch.optim.Optimizer]:
    built = build_schedule(schedule, ranks=ranks, microbatches=M)
    pipe = Pipeline(_model(), built, token_loss, options=replace(OPTIONS, seed=5), **kw)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.01)


def _save_on_2_zbv(rank: int, world: int, path: str) -> list[float]:
    pipe, opt = _pipe("zbv", world)
    losses = _run(pipe, opt, range(SAVED_AT))
    save_checkpoint(pipe, opt, path, extra={"step": SAVED_AT}, meta={"by": "zbv"})
    return losses


def _resume(rank: int, world: int, path: str, schedule: str) -> list[float]:
    pipe, opt = _pipe(schedule, world)
    extra = load_checkpoint(pipe, opt, path)
    assert extra == {"step": SAVED_AT}
    return _run(pipe, opt, range(SAVED_AT, STEPS))


def _resume_2x2(rank: int, world: int, path: str) -> list[float]:
    """2 pipeline ranks x 2 data-parallel replicas, each stepping on half of every batch."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pipe = Pipeline(
        _model(),
        "1f1b",
        token_loss,
        microbatches=M // 2,
        mesh=mesh,
        options=replace(OPTIONS, seed=5),
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.01)
    assert load_checkpoint(pipe, opt, path) == {"step": SAVED_AT}
    losses = []
    for step in range(SAVED_AT, STEPS):
        x, y = (t.tensor_split(2)[pipe.dp_rank] for t in _batch(step))
        losses.append(pipe.step(x, y).item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def _resume_on_4_then_on_2x2(rank: int, world: int, path: str) -> tuple[list[float], ...]:
    """The 4 processes resume as 4 pipeline ranks under 1f1b, then as 2 x 2 replicas: two
    pipelines, each loading the checkpoint afresh, in one launch."""
    return _resume(rank, world, path, "1f1b"), _resume_2x2(rank, world, path)


def test_saved_on_2_ranks_with_zbv_resumes_on_4_with_1f1b_on_2x2_replicas_and_on_1_process(
    tmp_path: Path,
) -> None:
    reference, ref_opt = _pipe("1f1b", 1)
    expected = _run(reference, ref_opt, range(STEPS))
    path = str(tmp_path / "ckpt")
    before = launch(_save_on_2_zbv, 2, path, timeout=120, threads=1)
    assert before[0] == pytest.approx(expected[:SAVED_AT], abs=1e-12)
    manifest = verify_checkpoint(path)
    assert manifest["meta"] == {"by": "zbv"} and manifest["aliases"] == {
        "7.proj.weight": "0.weight"
    }
    # each rank wrote its own file (zbv puts stages 0 and 3 on rank 0, 1 and 2 on rank 1)
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    written = {
        index.fqn: info.relative_path
        for index, info in dcp.FileSystemReader(path).read_metadata().storage_data.items()
    }
    for key, file in written.items():
        if key.startswith(("model.", "optim.")):  # layers 0-1, 6-7 on rank 0; 2-5 on rank 1
            layer = int(key.split(".")[1])
            assert file == ("__0_0.distcp" if layer in (0, 1, 6, 7) else "__1_0.distcp"), key
    assert "model.7.proj.weight" not in written  # the tied head: stored once, as 0.weight
    resumed = launch(_resume_on_4_then_on_2x2, 4, path, timeout=120, threads=1)
    after_4, after_2x2 = [r[0] for r in resumed], [r[1] for r in resumed]
    local, opt = _pipe("1f1b", 1)
    assert load_checkpoint(local, opt, path) == {"step": SAVED_AT}
    after_1 = _run(local, opt, range(SAVED_AT, STEPS))
    for losses in (after_4[0], after_4[3], after_1, *after_2x2):
        assert losses == pytest.approx(expected[SAVED_AT:], abs=1e-9, rel=0)
    assert after_1 != pytest.approx(expected[:SAVED_AT], abs=1e-3)  # the steps did move


def test_keys_are_the_models_own_and_a_tied_weight_is_stored_once(tmp_path: Path) -> None:
    model = _model()
    pipe = Pipeline(
        model, build_schedule("zbv", ranks=2, microbatches=M), loss_fn=token_loss, options=OPTIONS
    )
    names = state_names(pipe)
    assert set(names.tensors) == set(model.state_dict()) - {"7.proj.weight"}
    assert names.aliases == {"7.proj.weight": "0.weight"}
    opt = torch.optim.AdamW(pipe.parameters())
    _run(pipe, opt, range(1))
    save_checkpoint(pipe, opt, tmp_path / "c")
    tensors, aliases = consolidated_state_dict(tmp_path / "c")
    assert aliases == {"7.proj.weight": "0.weight"}
    assert set(tensors) == set(names.tensors)
    for name, t in model.state_dict().items():
        assert torch.equal(tensors[aliases.get(name, name)], t), name


def test_stage_modules_take_the_names_of_the_model_they_were_cut_from(tmp_path: Path) -> None:
    model = _model()
    stages = [nn.Sequential(*list(model)[i : i + 2]) for i in range(0, 8, 2)]
    pipe = Pipeline(stages, "1f1b", loss_fn=token_loss, microbatches=M, options=OPTIONS)
    by_position = state_names(pipe)
    # without the model: the names nn.Sequential(*stages) would give them
    whole = set(nn.Sequential(*stages).state_dict())
    assert set(by_position.tensors) | set(by_position.aliases) == whole
    named = state_names(pipe, model)
    assert set(named.tensors) | set(named.aliases) == set(model.state_dict())
    save_checkpoint(pipe, None, tmp_path / "c", model=model)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    load_checkpoint(
        Pipeline(other, build_schedule("gpipe", ranks=2, microbatches=M), loss_fn=token_loss),
        None,
        tmp_path / "c",
    )
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(CheckpointError, match="not a tensor of the model passed as model="):
        state_names(pipe, _model())


def test_keys_shapes_and_dtypes_that_differ_are_named(tmp_path: Path) -> None:
    pipe, opt = _pipe("1f1b", 2)
    save_checkpoint(pipe, opt, tmp_path / "c")
    wider = token_model(layers=8, width=10)
    with pytest.raises(CheckpointError, match=r"holds '0\.weight' as torch\.float64 \[11, 8\]"):
        load_checkpoint(
            Pipeline(wider, build_schedule("1f1b", ranks=2, microbatches=M), loss_fn=token_loss),
            None,
            tmp_path / "c",
        )
    single = token_model(layers=8, dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"float64 \[11, 8\], the model has torch\.float32"):
        load_checkpoint(
            Pipeline(single, build_schedule("1f1b", ranks=2, microbatches=M), loss_fn=token_loss),
            None,
            tmp_path / "c",
        )
    deeper = token_model(layers=10)
    with pytest.raises(CheckpointError, match=r"lacks '[0-9]\..*'.*the model it was saved from"):
        load_checkpoint(
            Pipeline(deeper, build_schedule("1f1b", ranks=2, microbatches=M), loss_fn=token_loss),
            None,
            tmp_path / "c",
        )
    shallower = token_model(layers=6)
    with pytest.raises(
        CheckpointError, match=r"lacks '5\.norm\.bias'.* and holds '5\.body.*and 10 more, which"
    ):
        load_checkpoint(
            Pipeline(
                shallower, build_schedule("1f1b", ranks=2, microbatches=M), loss_fn=token_loss
            ),
            None,
            tmp_path / "c",
        )


def test_a_changed_or_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    pipe, opt = _pipe("1f1b", 2)
    _run(pipe, opt, range(1))
    save_checkpoint(pipe, opt, tmp_path / "c")
    data = tmp_path / "c" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is corrupt .*sha256"):
        load_checkpoint(pipe, opt, tmp_path / "c")
    data.unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing"):
        verify_checkpoint(tmp_path / "c")
    (tmp_path / "c" / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint: it has no manifest"):
        load_checkpoint(pipe, opt, tmp_path / "c")


_KILLED_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, {root!r})
from tests.runtime.checkpoint.test_checkpoint import _pipe, _run
from zeropipe.runtime.checkpoint import dcp as checkpoint, folder as checkpoint_folder
pipe, opt = _pipe("1f1b", 2)
_run(pipe, opt, range(1))
checkpoint.save_checkpoint(pipe, opt, {first!r}, extra="first")
_run(pipe, opt, range(1, 2))
# Every DCP file of the second save is written; die as the manifest's hashes are taken.
checkpoint_folder.sha256_of = lambda path: os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save_checkpoint(pipe, opt, {second!r}, extra="second")
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    first, second = tmp_path / "step-1", tmp_path / "step-2"
    script = _KILLED_SAVE.format(root=os.getcwd(), first=str(first), second=str(second))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    partial = tmp_path / ".step-2.partial"
    assert (partial / ".metadata").exists() and not second.exists()  # killed after DCP wrote
    with pytest.raises(CheckpointError, match=r"interrupted: its \.partial folder"):
        load_checkpoint(*_pipe("1f1b", 2), second)
    pipe, opt = _pipe("gpipe", 2)
    assert load_checkpoint(pipe, opt, first) == "first"
    assert verify_checkpoint(first)["files"]
    save_checkpoint(pipe, opt, second, extra="again")  # the next save replaces the leftover
    assert not partial.exists() and load_checkpoint(pipe, opt, second) == "again"
