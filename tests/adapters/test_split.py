"""``zeropipe.split`` without transformers, and ``causal_lm_loss`` under a pipeline."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import zeropipe
from zeropipe import build_schedule
from zeropipe.adapters.loss import CausalLMLoss
from zeropipe.core.errors import PipelineError


def test_a_sequential_is_cut_into_slices_of_its_own_layers() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    stages = zeropipe.split(model, 2)
    assert [len(s) for s in stages] == [3, 2]
    assert [id(p) for s in stages for p in s.parameters()] == [id(p) for p in model.parameters()]
    assert [len(s) for s in zeropipe.split(model, 2, balance=[1, 4])] == [1, 4]
    with pytest.raises(PipelineError, match="too few for 6 stages"):
        zeropipe.split(model, 6)
    with pytest.raises(PipelineError, match="positive int"):
        zeropipe.split(model, 0)


def test_other_models_are_refused_naming_what_works() -> None:
    with pytest.raises(PipelineError, match=r"cannot cut GRU: it supports nn\.Sequential.*by hand"):
        zeropipe.split(nn.GRU(4, 4), 2)


class _Tiny(nn.Module):
    """Embedding + linear head: logits [batch, seq, vocab]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8, dtype=torch.float64)
        self.out = nn.Linear(8, 11, dtype=torch.float64)

    def forward(self, ids: Tensor) -> Tensor:
        return self.out(torch.tanh(self.embed(ids)))


def test_causal_lm_loss_is_the_shifted_mean_and_exact_over_uneven_microbatches() -> None:
    torch.manual_seed(0)
    model = _Tiny()
    ids = torch.randint(0, 11, (5, 7))
    labels = ids.clone()
    labels[0, :6] = -100  # microbatches count very different numbers of tokens
    labels[2, 3:] = -100
    logits = model(ids)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    loss = zeropipe.causal_lm_loss(logits, labels)
    assert torch.allclose(loss, expected, rtol=0, atol=1e-14)
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    stages = [model.embed, nn.Sequential(nn.Tanh(), model.out)]
    pipe = zeropipe.Pipeline(
        stages, build_schedule("1f1b", ranks=2, microbatches=5), loss_fn=zeropipe.causal_lm_loss
    )
    assert abs(pipe.step(ids, labels).item() - loss.item()) < 1e-14
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref[n], rtol=0, atol=1e-14), n


def test_causal_lm_loss_refuses_a_second_count_and_bad_shapes() -> None:
    with pytest.raises(PipelineError, match=r"counts its own items.*drop loss_count="):
        zeropipe.Pipeline(
            [nn.Identity(), nn.Identity()],
            build_schedule("1f1b", ranks=2, microbatches=2),
            loss_fn=zeropipe.causal_lm_loss,
            loss_count=lambda y: (y != -100).sum(),
        )
    with pytest.raises(PipelineError, match=r"labels \[2, 3\] must be \[batch, seq\]"):
        zeropipe.causal_lm_loss(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(PipelineError, match=r"logits \[batch, seq, vocab\]"):
        zeropipe.causal_lm_loss(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long))
    assert repr(CausalLMLoss(ignore_index=0)) == "CausalLMLoss(ignore_index=0)"
