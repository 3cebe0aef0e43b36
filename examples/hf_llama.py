"""A Hugging Face Llama-style model, built from a config, pipelined over 2 processes.

``zeropipe.split`` cuts the model into stages that hold its own modules (nothing
is copied), so the optimizer steps ``model.parameters()`` as it would without a
pipeline; ``zeropipe.causal_lm_loss`` is the model's own shifted cross-entropy,
normalised over the batch's counted tokens (labels of -100 are not counted).
Needs transformers (``pip install -e '.[hf]'``); nothing is downloaded.

    torchrun --nproc-per-node 2 examples/hf_llama.py
    python examples/hf_llama.py          # the same, 2 processes via zeropipe.launch
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

import zeropipe

STEPS = 30


def text_batches(batch: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Byte tokens of this repository's README, as (input_ids, labels) pairs."""
    raw = (Path(__file__).resolve().parent.parent / "README.md").read_bytes()
    tokens = torch.tensor(list(raw), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        starts = torch.randint(0, len(tokens) - seq, (batch,), generator=g).tolist()
        ids = torch.stack([tokens[s : s + seq] for s in starts])
        labels = ids.clone()
        labels[:, : seq // 4] = -100  # e.g. a prompt whose tokens the loss does not count
        out.append((ids, labels))
    return out


def train(rank: int, world: int) -> list[float]:
    # Imported where the model is built: the process that only launches the ranks needs none
    # of transformers (each rank imports this script again, then runs this function).
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)  # every rank builds the same model
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(config)
    stages = zeropipe.split(model, 2 * world)  # zbv: 2 stages per rank, cut by measured time
    pipe = zeropipe.Pipeline(stages, "zbv", microbatches=4, loss_fn=zeropipe.causal_lm_loss)
    # The model's own parameters: those of other ranks' stages get no gradient and stay.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step, (ids, labels) in enumerate(text_batches(batch=8, seq=64)):
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(ids, labels)  # the loss of model(ids, labels=labels), every rank
        opt.step()
        losses.append(loss.item())
        if rank == 0 and step % 10 == 9:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    return losses


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        train(*zeropipe.init_from_env())
    else:
        losses = zeropipe.launch(train, 2)[0]
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
