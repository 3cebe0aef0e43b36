"""Load a schedule from a text file, check it, simulate it, and run it on a model.

python examples/schedule_from_file.py [examples/custom.schedule]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from zeropipe import CostModel, Pipeline, Schedule, simulate, validate
from zeropipe.core.render import render_text


def main(path: str) -> None:
    schedule = Schedule.from_text(Path(path).read_text())
    validate(schedule)  # raises ScheduleError with the failing step marked if it is wrong
    costs = CostModel.uniform(schedule.num_stages, F=1, I=1, W=0.5)
    print(render_text(simulate(schedule, costs), width=72))

    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(4)]
    )
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    expected = F.mse_loss(model(x), y)
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss)  # 4 layers cut into the file's 2 stages
    loss = pipe.step(x, y)
    print(f"pipeline loss {loss.item():.6f}  plain model loss {expected.item():.6f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("custom.schedule")))
