"""What each rank runs in the failure cases: a stage that raises, dies, stalls or changes its
output's shape mid-run, and the launch entry points that fail or never end.

The three mid-step cases run inside ``dist_cases``' shared launch (``main_cases``), after
its healthy cases; test_failures.py reads them and launches the entry points itself.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.core.errors import PipelineError
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions
from zeropipe.runtime.transport.tagged import DistributedTransport

OPTIONS = RuntimeOptions(timeout=30.0)  # seconds a rank waits for a peer, as in dist_cases
SHORT_TIMEOUT, STALL = 1.0, 2.5  # the stalled-peer case: a wait times out, the peer wakes later


class _Flex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.extra = nn.Linear(4, 4), 0

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        return torch.cat([h, h[:, : self.extra]], dim=1) if self.extra else h


class _Sink(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x[:, :4])


class Trap(nn.Module):
    """A stage that, once armed, raises, kills its process, or stalls (``how``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin, self.how, self.armed = nn.Linear(4, 4), how, False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed and self.how == "raise":
            raise ValueError("boom from stage 1")
        if self.armed and self.how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.armed and self.how == "stall":
            self.armed = False
            time.sleep(STALL)
        return self.lin(x)


def _steps_until_failure(pipe: Pipeline, arm: Callable[[], None]) -> dict[str, Any]:
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    arm()
    start = time.monotonic()
    try:
        pipe.step(x, y)
        return {"error": None, "seconds": time.monotonic() - start}
    except PipelineError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}


def mismatch_case(rank: int, world: int) -> dict[str, Any]:
    first = _Flex()
    stages = [first, *[_Sink() for _ in range(world - 1)]]
    pipe = Pipeline(stages, "1f1b", microbatches=4, loss_fn=F.mse_loss, options=OPTIONS)
    out = _steps_until_failure(pipe, lambda: setattr(first, "extra", 1))
    try:  # a failed pipeline refuses further steps instead of mixing up messages
        pipe.step(torch.randn(8, 4), torch.randn(8, 4))
        out["after"] = None
    except PipelineError as err:
        out["after"] = str(err)
    return out


def forward_error_case(rank: int, world: int) -> dict[str, Any]:
    trap = Trap("raise")
    stages = [nn.Linear(4, 4), trap, *[nn.Linear(4, 4) for _ in range(world - 2)]]
    pipe = Pipeline(stages, "1f1b", microbatches=4, loss_fn=F.mse_loss, options=OPTIONS)
    return _steps_until_failure(pipe, lambda: setattr(trap, "armed", True))


def stalled_peer_case(rank: int, world: int) -> dict[str, Any]:
    """Stage 1 stalls (alive, silent) longer than the pipeline's timeout on step 2."""
    trap = Trap("stall")
    stages = [nn.Linear(4, 4), trap, *[nn.Linear(4, 4) for _ in range(world - 2)]]
    pipe = Pipeline(stages, "1f1b", microbatches=4, loss_fn=F.mse_loss, options=OPTIONS)
    transport = pipe.transport
    assert isinstance(transport, DistributedTransport)

    def arm() -> None:
        # Start step 2 together, with the short timeout: on a busy host the ranks'
        # skew from earlier cases would otherwise eat into it.
        dist.barrier()
        transport.timeout = SHORT_TIMEOUT
        trap.armed = True

    return _steps_until_failure(pipe, arm)


# -- launch entry points ------------------------------------------------------------------
def killed_case(rank: int, world: int) -> None:
    """Rank 1 SIGKILLs itself inside a stage's forward on the second step."""
    trap = Trap("kill")
    stages = [nn.Linear(4, 4), trap, *[nn.Linear(4, 4) for _ in range(world - 2)]]
    pipe = Pipeline(stages, "1f1b", microbatches=4, loss_fn=F.mse_loss, options=OPTIONS)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    trap.armed = True
    pipe.step(x, y)  # the survivors' PipelineError goes to the launcher


def raise_on_rank1(rank: int, world: int) -> str:
    """Ranks 0-1 pipeline over a subgroup; 1 raises outside any step, 2 idles forever.

    Rank 0 can learn of it only from the launcher (through the store); rank 2
    only the launcher can end.
    """
    sub = dist.new_group([0, 1])
    if rank == 2:
        time.sleep(600)
    pipe = Pipeline(
        [nn.Linear(4, 4), nn.Linear(4, 4)],
        "1f1b",
        loss_fn=F.mse_loss,
        microbatches=2,
        mesh=sub,
        options=OPTIONS,
    )
    if rank == 1:
        raise ValueError("bad input on rank 1")
    pipe.step(torch.randn(4, 4), torch.randn(4, 4))
    return "unreachable"


def train_forever(rank: int, world: int, folder: str) -> None:
    """Train until killed; after the first step, write this process's pid to ``folder``."""
    stages = [nn.Linear(4, 4) for _ in range(world)]
    pipe = Pipeline(stages, "1f1b", microbatches=4, loss_fn=F.mse_loss, options=OPTIONS)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.step(x, y)
    path = os.path.join(folder, f"rank{rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # whole, or not there yet
    while True:
        pipe.step(x, y)


def sleep_forever(rank: int, world: int) -> None:
    time.sleep(600)
