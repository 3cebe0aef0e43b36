"""Train a model whose weights do not fit on the device: weight offload with prefetch.

fairscale's OffloadModel keeps a model on the host and brings one slice at a
time onto the GPU.  Here that is a schedule: the model is cut into stages run
one after another on one device (``looped-bfs`` on one rank: every
microbatch through stage 0, then stage 1, ...), and ``offload_weights`` adds a
RELOAD of each stage's weights one compute action before it runs (so the
copy overlaps the previous stage's compute, on a copy stream on a GPU) and an
OFFLOAD right after.  At most two stages' weights are on the device at once.
Between steps the parameters and their gradients live in host memory, where
the optimizer steps them.

    python examples/offload_model.py                   # CPU: the same schedule, real copies
    python examples/offload_model.py --device cuda     # a GPU
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from zeropipe import Pipeline, RuntimeOptions, generate
from zeropipe.core.passes.fit import offload_weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    h = args.hidden
    # Built on the host: the model as a whole never has to fit on the device.
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(h, h), nn.Tanh()) for _ in range(2 * args.stages)]
    )
    schedule = offload_weights(
        generate("looped-bfs", 1, args.microbatches, chunks=args.stages), prefetch=1
    )
    pipe = Pipeline(model, schedule, loss_fn=F.mse_loss, options=RuntimeOptions(device=args.device))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # steps the host copies
    x = torch.randn(32, h)
    y = 0.5 * torch.tanh(x)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for step in range(args.steps):
        loss = pipe.step(x, y)  # the batch is moved to the device by the pipeline
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:2d}  loss {loss.item():.4f}")
    resident = max(pipe.memory.report.weights)
    print(f"weights resident on {pipe.device} at most: {resident} of {model_bytes} bytes "
          f"({resident / model_bytes:.0%})")  # fmt: skip
    allocated = pipe.memory.report.allocated
    if allocated is not None:
        print(f"device allocator peak: {allocated} bytes")


if __name__ == "__main__":
    main()
