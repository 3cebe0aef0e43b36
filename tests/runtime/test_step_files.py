"""One local step stays readable: the runtime files it enters are few, and counted here.

``Pipeline.step`` -> ``pipeline.py`` (prepare, execute, finish) -> the executor walks
the schedule -> a handler per action -> the stage's forward, the loss, the memory
accounting, the in-process transport.  A plain step (no shared parameters, replicas,
deferred BatchNorms or earlier gradients) enters nothing else; this test fails, naming
the files, when a change makes it walk through more.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import FrozenInstanceError
from pathlib import Path
from types import FrameType

import pytest
import torch
from torch import nn

import zeropipe
from zeropipe import Pipeline, build_schedule

RUNTIME = Path(zeropipe.__file__).parent / "runtime"
# pipeline, step/executor (with the in-process transport), step/handlers, step/stage,
# step/loss_contract, memory/manager
MOST_FILES = 6
# and, with replicas (pp 2 x dp 2 over gloo): transport/tagged, transport/endpoint,
# transport/wire, replicas/data_parallel
MOST_FILES_WITH_REPLICAS = 10


@contextmanager
def runtime_files_entered() -> Iterator[set[str]]:
    """The files under zeropipe/runtime/ whose Python functions run inside the block."""
    seen: set[str] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)
        inside = {f for f in seen if Path(f).is_relative_to(RUNTIME)}
        seen.clear()
        seen.update(str(Path(f).relative_to(RUNTIME)) for f in inside)


@pytest.mark.parametrize(("name", "ranks"), [("1f1b", 2), ("zbv", 2), ("zb-h1", 2)])
def test_a_local_step_enters_few_runtime_files(name: str, ranks: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    pipe = Pipeline(model, build_schedule(name, ranks=ranks, microbatches=4), nn.MSELoss())
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe.step(x, y)  # the first step learns shapes and counts saved bytes once
    model.zero_grad(set_to_none=True)
    with runtime_files_entered() as files:
        loss = pipe.step(x, y)
    assert torch.isfinite(loss)
    assert "pipeline.py" in files and "step/handlers.py" in files  # the profile saw the step
    assert len(files) <= MOST_FILES, (
        f"one local {name} step enters {len(files)} runtime files, more than {MOST_FILES}: "
        f"{sorted(files)}"
    )


def test_a_step_with_replicas_enters_few_runtime_files() -> None:
    from tests.gradcheck import no_crash
    from tests.runtime import dp_cases

    for out in dp_cases.results():
        no_crash(out["files"], "runtime files of a step with replicas")
        # A wait that stalls (a loaded machine) also asks failures.py whether a peer failed.
        files = [f for f in out["files"] if f != "transport/failures.py"]
        assert {"replicas/data_parallel.py", "transport/tagged.py"} <= set(files)  # it was seen
        assert len(files) <= MOST_FILES_WITH_REPLICAS, (
            f"one 1f1b step on pp 2 x dp 2 enters {len(files)} runtime files, more than "
            f"{MOST_FILES_WITH_REPLICAS}: {files}"
        )


def test_a_step_with_shared_parameters_still_sums_them() -> None:
    # The step's end enters grad_sums.py only when there is something to sum or refuse:
    # a parameter used by several stages is checked for hooks at every step.
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    pipe = Pipeline([first, last], build_schedule("1f1b", ranks=2, microbatches=2), nn.MSELoss())
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    with runtime_files_entered() as files:
        pipe.step(x, y)
    assert "replicas/grad_sums.py" in files
    first.weight.register_hook(lambda g: g)
    with pytest.raises(zeropipe.PipelineError, match="gradient hook"):
        pipe.step(x, y)


def test_the_parts_are_built_once_and_frozen() -> None:
    pipe = Pipeline(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)),
        build_schedule("1f1b", ranks=2, microbatches=2),
        nn.MSELoss(),
    )
    with pytest.raises(FrozenInstanceError):
        pipe.parts.transport = pipe.parts.transport  # type: ignore[misc]
    assert pipe.schedule is pipe.parts.schedule and pipe.memory is pipe.parts.memory
    assert pipe.parts.reducer is None and pipe.parts.sharded is None  # no replicas
    assert pipe.parts.norms is None  # no deferred BatchNorm in these stages
    assert pipe.parts.owns_last and set(pipe.stages) == {0, 1}
