"""What cannot work is refused at once, in one line, and a failed step leaves nothing behind.

- ``zeropipe train`` configurations the machine cannot hold (a 7B config, 64 ranks of a
  200-block GPT, 100000 ranks) are refused before anything is launched or built;
- a step that fails midway in one process gives every ``.grad`` back as it was;
- counts that are not whole numbers (``microbatches=2.5``) are one-line errors;
- ``zeropipe simulate --schedule`` on a binary file, a folder or a missing file is one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeropipe
from tests.gradcheck import batch_for, mlp, reference
from zeropipe.apps.cli import main
from zeropipe.apps.models.gpt import GPTConfig, gpt
from zeropipe.apps.train import workload
from zeropipe.apps.train.config import TrainConfig
from zeropipe.core.errors import PipelineError, ScheduleError, ZeropipeError

GiB = 2**30


# -- configurations that do not fit the machine ------------------------------------------
# Run in a child with a time limit, so that a regression (building the model, generating a
# schedule of 100000 ranks) fails the test in a minute instead of hanging it.  The child
# pretends the machine has 16 GiB available, so the outcome does not depend on this one, and
# a process limit of 4096, then none (the last case).
_CASES = """
import json, sys, time
from zeropipe.apps.train import workload
from zeropipe.apps.train.config import TrainConfig
workload.available_memory = lambda: 16 * 2**30
cfg_file = sys.argv[1]
cases = {
    "llama-7b": (4096, lambda: TrainConfig(model="llama", model_config=cfg_file, steps=1).check()),
    "64-ranks": (4096, lambda: TrainConfig(ranks=64, blocks=200, steps=1).check()),
    # check_model is what refuses it; TrainConfig.check calls it after building the schedule
    "100000-ranks": (4096, lambda: workload.check_model(TrainConfig(ranks=100000, steps=1))),
    "100000-ranks, no process limit": (
        None, lambda: workload.check_model(TrainConfig(ranks=100000, steps=1))
    ),
}
out = {}
for name, (limit, case) in cases.items():
    workload.process_limit = lambda limit=limit: limit
    t0 = time.perf_counter()
    try:
        case()
        out[name] = {"error": None}
    except Exception as exc:
        out[name] = {"error": str(exc), "type": type(exc).__name__}
    out[name]["seconds"] = time.perf_counter() - t0
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def refusals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    pytest.importorskip("transformers")
    cfg_file = tmp_path_factory.mktemp("refusals") / "config.json"
    cfg_file.write_text(json.dumps({"model_type": "llama"}))  # every size a default: ~7B
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CASES), str(cfg_file)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, dict[str, object]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _one_line_error(case: dict[str, object]) -> str:
    error = case["error"]
    assert isinstance(error, str), f"not refused: {case}"
    assert case["type"] == "ZeropipeError", case
    assert "\n" not in error, error
    seconds = case["seconds"]
    assert isinstance(seconds, float) and seconds < 20, f"refused only after {seconds:.1f} s"
    return error


def test_a_7b_config_is_refused_before_it_is_built(refusals: dict[str, dict[str, object]]) -> None:
    error = _one_line_error(refusals["llama-7b"])
    assert "6,738M parameters" in error  # LlamaConfig()'s defaults, counted without building
    assert "16.0 GiB available" in error
    assert "smaller --model-config" in error and "hidden_size" in error
    assert "--ranks 1 or fewer" not in error  # one rank does not fit either: only a smaller model


def test_64_ranks_of_a_200_block_gpt_are_refused(refusals: dict[str, dict[str, object]]) -> None:
    error = _one_line_error(refusals["64-ranks"])
    assert error.startswith("--ranks 64 needs about "), error
    assert "built whole in each of 64 processes" in error
    # The fix names a rank count that fits the 16 GiB.
    fits = int(error.split("use --ranks ")[1].split()[0])
    assert 1 <= fits < 64


def test_more_ranks_than_processes_are_refused(refusals: dict[str, dict[str, object]]) -> None:
    error = _one_line_error(refusals["100000-ranks"])
    assert "would start 100000 processes" in error and "ulimit -u: 4096" in error


def test_more_ranks_than_layers_are_refused_without_a_process_limit(
    refusals: dict[str, dict[str, object]],
) -> None:
    error = _one_line_error(refusals["100000-ranks, no process limit"])
    assert "--ranks 100000 needs at least 100000 stages but the model has 10 layers" in error
    assert "use fewer ranks or more --blocks (at most 10 ranks for this model)" in error


def test_what_fits_is_not_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # The built-in demo: 2 ranks and a launcher of ~256 MiB each, on a 1 GiB machine.
    monkeypatch.setattr(workload, "available_memory", lambda: 1 * GiB, raising=False)
    TrainConfig(steps=1).check()
    monkeypatch.setattr(workload, "available_memory", lambda: None, raising=False)
    TrainConfig(ranks=8, blocks=200, steps=1).check()  # memory unknown: not refused


def test_model_size_counts_what_is_built() -> None:
    cfg = TrainConfig(width=32, heads=4, blocks=3, seq=16)
    count, nbytes = workload.model_size(cfg, vocab=40)
    built = gpt(GPTConfig(vocab=40, seq=16, width=32, heads=4, layers=3))
    assert count == sum(p.numel() for p in built.parameters())  # the tied weight once
    assert nbytes == 4 * count


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])
def test_model_size_of_a_config_file(tmp_path: Path, model_type: str) -> None:
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 64, "num_hidden_layers": 3, "tie_word_embeddings": False}
    if model_type == "gpt2":
        small |= {"n_embd": 16, "n_head": 2, "n_positions": 32}
    else:
        small |= {"hidden_size": 16, "intermediate_size": 24, "num_attention_heads": 2}
        small |= {"num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 32}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **small}))
    cfg = TrainConfig(model=model_type, model_config=str(path), seq=16)
    count, _ = workload.model_size(cfg, vocab=40)
    config = transformers.AutoConfig.for_model(model_type, **small)
    built = transformers.AutoModelForCausalLM.from_config(config)
    assert count == sum(p.numel() for p in built.parameters())


# -- a step that fails midway ------------------------------------------------------------
class _Boom(nn.Module):
    """The identity, raising on its ``fail_at``-th call (counted from 0) when armed."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: int | None = None
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.fail_at is not None:
            self.calls += 1
            if self.calls - 1 == self.fail_at:
                raise RuntimeError("boom in a stage's forward")
        return x


def _loss_raising_at(k: int | None) -> tuple[list[int], object]:
    calls = [0]

    def loss(out: Tensor, target: Tensor) -> Tensor:
        # the mean probe's halves of a microbatch (see runtime/step/loss_contract.py)
        if out.shape[0] < 2:
            return F.mse_loss(out, target)
        calls[0] += 1
        if k is not None and calls[0] - 1 == k:
            raise RuntimeError(f"the loss of microbatch {k} raises")
        return F.mse_loss(out, target)

    return calls, loss


SCHEDULES = [("1f1b", 2, 1), ("zb-h1", 2, 1), ("zbv", 2, 2), ("interleaved-1f1b", 2, 2)]


@pytest.fixture
def model() -> Iterator[nn.Sequential]:
    torch.manual_seed(0)
    blocks = list(mlp(layers=8, width=6).children())
    boom = _Boom()
    yield nn.Sequential(*blocks[:5], boom, *blocks[5:])


def _known_grads(model: nn.Module, with_grads: bool) -> dict[str, Tensor | None]:
    g = torch.Generator().manual_seed(5)
    known: dict[str, Tensor | None] = {}
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g) if with_grads else None
        known[name] = None if p.grad is None else p.grad.clone()
    return known


@pytest.mark.parametrize(("name", "ranks", "chunks"), SCHEDULES)
@pytest.mark.parametrize("where", ["loss", "forward"])
@pytest.mark.parametrize("with_grads", [True, False])
def test_a_failed_step_leaves_the_gradients_as_they_were(
    model: nn.Sequential, name: str, ranks: int, chunks: int, where: str, with_grads: bool
) -> None:
    microbatches = 4
    schedule = zeropipe.build_schedule(name, ranks=ranks, microbatches=microbatches, chunks=chunks)
    calls, loss_fn = _loss_raising_at(2 if where == "loss" else None)
    pipe = zeropipe.Pipeline(model, schedule, loss_fn, mesh="local")
    x, y = batch_for(model, batch=8)
    known = _known_grads(model, with_grads)
    held = {n: p.grad for n, p in model.named_parameters()}  # a caller's references
    boom = model[5]
    assert isinstance(boom, _Boom)
    boom.fail_at = 2 if where == "forward" else None
    with pytest.raises(PipelineError, match=r"boom|raises"):
        pipe.step(x, y)
    if where == "loss":
        assert calls[0] == 3  # it failed at microbatch 2, after others' backward had run
    for n, p in model.named_parameters():
        want = known[n]
        if want is None:
            assert p.grad is None, f"{n}: the failed step left a gradient"
        else:
            assert p.grad is held[n], f"{n}: .grad is another tensor"
            assert p.grad is not None and torch.equal(p.grad, want), f"{n}: .grad changed"

    # The pipeline goes on: the next step adds exactly the batch's gradients.
    boom.fail_at = None
    calls[0] = -(10**9)  # the loss no longer raises
    loss = pipe.step(x, y)
    ref_loss, ref = reference(model, x, y, F.mse_loss, microbatches)
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    for n, p in model.named_parameters():
        before = known[n]
        want = ref[n] if before is None else before + ref[n]
        assert p.grad is not None and (p.grad - want).abs().max().item() < 1e-12, n
    out = pipe.eval_step(x, y)  # and a forward-only step after it
    assert isinstance(out, Tensor) and abs(out.item() - ref_loss.item()) < 1e-12


# -- counts that are not whole numbers -----------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"ranks": 2, "microbatches": 2.5}, "microbatches must be a whole number >= 1, got 2.5"),
        ({"ranks": 1.5, "microbatches": 4}, "ranks must be a whole number >= 1, got 1.5"),
        ({"ranks": 2, "microbatches": 4, "chunks": 1.5}, "chunks must be a whole number >= 1"),
        ({"ranks": 2, "microbatches": True}, "microbatches must be a whole number >= 1, got True"),
        ({"ranks": 2, "microbatches": "4"}, "microbatches must be a whole number >= 1, got '4'"),
        ({"ranks": 2, "microbatches": 0}, "microbatches must be a whole number >= 1, got 0"),
    ],
)
def test_build_schedule_refuses_counts_that_are_not_whole(
    kwargs: dict[str, object], named: str
) -> None:
    with pytest.raises(ScheduleError) as info:
        zeropipe.build_schedule("interleaved-1f1b", **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == named or str(info.value).startswith(named)
    assert "\n" not in str(info.value)


def test_build_schedule_takes_numpy_integers() -> None:
    np = pytest.importorskip("numpy")
    built = zeropipe.build_schedule("1f1b", ranks=np.int64(2), microbatches=np.int32(4))
    assert (built.num_ranks, built.microbatches) == (2, 4)


def test_pipeline_refuses_fractional_microbatches() -> None:
    layers = [nn.Linear(2, 2), nn.Linear(2, 2)]
    named = "microbatches must be a whole number >= 1, got 2.5"
    schedule = zeropipe.build_schedule("1f1b", ranks=2, microbatches=4)
    for stages, sched, mesh in (
        (layers, "1f1b", None),  # a stage per module
        (nn.Sequential(*layers), "1f1b", "local"),  # refused before "how many ranks?"
        (nn.Sequential(*layers), schedule, "local"),
    ):
        with pytest.raises(PipelineError) as info:
            zeropipe.Pipeline(stages, sched, F.mse_loss, microbatches=2.5, mesh=mesh)
        assert str(info.value) == named


# -- schedule files that are not schedules -------------------------------------------------
def _simulate(capsys: pytest.CaptureFixture[str], schedule: str) -> str:
    code = main(["simulate", "--schedule", schedule])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("zeropipe: error: ")
    return err


@pytest.mark.parametrize("suffix", [".txt", ".json", ".csv", ""])
def test_simulate_refuses_a_binary_schedule_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], suffix: str
) -> None:
    path = tmp_path / f"weights{suffix}"
    path.write_bytes(bytes(range(256)) * 8)  # not UTF-8 from byte 128
    err = _simulate(capsys, str(path))
    assert f"schedule file {path} is not text (byte 128 is not UTF-8)" in err
    assert "JSON (.json)" in err


def test_simulate_refuses_a_file_of_nul_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zeros.txt"
    path.write_bytes(b"\0" * 64)  # valid UTF-8, but no schedule
    err = _simulate(capsys, str(path))
    assert f"schedule file {path} is not text (it holds NUL bytes)" in err


def test_simulate_refuses_a_directory_and_a_missing_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _simulate(capsys, str(tmp_path))
    assert f"--schedule {tmp_path} is a directory; give a schedule file" in err
    err = _simulate(capsys, str(tmp_path / "missing.txt"))
    assert "does not exist" in err


def test_a_folder_named_like_a_generator_is_not_a_schedule_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "1f1b").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["simulate", "--schedule", "1f1b", "--ranks", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["schedule"] == "1f1b"


def test_a_model_path_run_is_sized_by_each_rank_s_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--model-path builds on meta and materialises a rank's own stages: the memory check
    counts a 1/ranks share of the model per rank, not the whole model in every rank."""
    pytest.importorskip("transformers")
    size = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16}
    size |= {"num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **size}))
    cfg = TrainConfig(model="llama", model_config=str(path), ranks=4, seq=16)
    _, model = workload.model_size(cfg, vocab=40)
    # Room for the launcher and 4 ranks, the model once and its gradients and AdamW state
    # (3x), with half a model to spare: not for 4 whole models.
    free = int(1.1 * (5 * workload.PROCESS_BYTES + 4.5 * model))
    monkeypatch.setattr(workload, "available_memory", lambda: free, raising=False)
    with pytest.raises(ZeropipeError, match="built whole in each of 4 processes"):
        workload.check_model(cfg)
    workload.check_model(replace(cfg, model_path=str(tmp_path)))  # a share each: fits
    tight = int(1.1 * (5 * workload.PROCESS_BYTES + 3.5 * model))
    monkeypatch.setattr(workload, "available_memory", lambda: tight, raising=False)
    with pytest.raises(ZeropipeError, match=r"shared out among 4 pipeline ranks.*more memory"):
        workload.check_model(replace(cfg, model_path=str(tmp_path)))
