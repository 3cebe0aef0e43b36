"""Hand-made stage modules, one per stage, trained with a zero-bubble schedule.

Each stage is an ordinary nn.Module; a stage's output (a tensor or a tuple of
tensors) is the next stage's input.  One process plays both ranks here (the
local executor); under torchrun the same code runs one rank per process.

    python examples/manual_stages.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe import Pipeline, generate, simulate
from zeropipe.core.render import render_text


class Encoder(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)

    def forward(self, tokens: Tensor) -> Tensor:  # integer token ids in
        return torch.tanh(self.mix(self.embed(tokens)))


class Decoder(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.norm(h))


def main() -> None:
    torch.manual_seed(0)
    vocab, width = 50, 32
    stages = [Encoder(vocab, width), Decoder(vocab, width)]
    schedule = generate("zb-h1", 2, 4)  # I and W split: W fills the bubbles
    print(render_text(simulate(schedule), width=72))

    def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))

    pipe = Pipeline(stages, schedule, loss_fn=loss_fn)
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.SGD(params, lr=0.5)
    tokens = torch.randint(0, vocab, (16, 6))
    for step in range(20):
        loss = pipe.step(tokens, tokens)  # learn to copy the input
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == 19:
            print(f"step {step:2d}  loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
