"""A mixture-of-experts layer whose experts run concurrently, inside a pipeline stage.

The router sends every token to its top-1 expert; the experts are independent
branches, so ``zeropipe.autograd.parallel_map`` runs their forwards and
backwards on a thread pool.  The MoE block is one layer of an nn.Sequential
that a zeropipe Pipeline cuts into stages; the script checks the pipeline's
gradients against the plain model and prints the loss.

    python examples/moe_parallel.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe import Pipeline, build_schedule
from zeropipe.autograd import parallel_map


class MoE(nn.Module):
    """Top-1 routed experts; experts run in parallel forward and backward."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
            for _ in range(experts)
        )

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        gate = F.softmax(self.router(flat), dim=-1)
        choice = gate.argmax(dim=-1)
        # Every expert gets a (possibly empty) slice of the tokens, in a fixed order.
        index = [torch.nonzero(choice == e).squeeze(1) for e in range(len(self.experts))]
        outs = parallel_map(self.experts, [flat[ix] for ix in index])
        mixed = torch.zeros_like(flat)
        for ix, out in zip(index, outs, strict=True):
            mixed = mixed.index_add(0, ix, out * gate[ix].gather(1, choice[ix, None]))
        return x + mixed.reshape(x.shape)


def build(width: int = 32, experts: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width),
        MoE(width, experts),
        nn.LayerNorm(width),
        MoE(width, experts),
        nn.Linear(width, width),
    ).double()


def main() -> None:
    torch.set_num_threads(1)
    model = build()
    x = torch.randn(16, 8, 32, dtype=torch.float64)
    y = torch.randn(16, 8, 32, dtype=torch.float64)
    F.mse_loss(model(x), y).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    pipe = Pipeline(
        model, build_schedule("1f1b", ranks=2, microbatches=4), loss_fn=F.mse_loss, balance=[2, 3]
    )
    loss = pipe.step(x, y)
    worst = max((p.grad - reference[n]).abs().max().item() for n, p in model.named_parameters())
    print(f"loss {loss.item():.6f}; max gradient difference vs the plain model {worst:.2e}")
    if worst > 1e-10:
        raise SystemExit("gradients differ from the plain model")


if __name__ == "__main__":
    main()
