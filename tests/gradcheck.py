"""The one shared gradient-equality helper: pipeline vs the same model run without a pipeline.

``reference(...)`` runs the plain ``nn.Sequential`` on the whole batch (or,
when the model has dropout, microbatch by microbatch with the runtime's
per-(step, microbatch, layer) seeds, so the masks match) and returns the loss
and every parameter's gradient.  ``assert_same_gradients`` compares a
pipeline's result with it: float64 to ``1e-10`` absolute, float32 with
``allclose(rtol=1e-5, atol=1e-6)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeropipe.runtime.step.stage import seeded

LossFn = Callable[[Tensor, Tensor], Tensor]


class Residual(nn.Module):
    """x + f(x): a residual block (Linear-GELU-Linear, optional dropout)."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.LayerNorm(width),
            nn.Linear(width, 2 * width),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(2 * width, width),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class TiedHead(nn.Module):
    """Output projection sharing the embedding's weight (tied input/output embeddings)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(embedding.embedding_dim)
        self.proj = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False)
        self.proj.weight = embedding.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.norm(x))


def mlp(
    layers: int = 16, width: int = 8, dropout: float = 0.0, dtype: torch.dtype = torch.float64
) -> nn.Sequential:
    """Float inputs: residual blocks with LayerNorm, GELU and (optional) dropout."""
    torch.manual_seed(1234)
    return nn.Sequential(*[Residual(width, dropout) for _ in range(layers)]).to(dtype)


def token_model(
    layers: int = 16,
    width: int = 8,
    vocab: int = 11,
    dropout: float = 0.0,
    dtype: torch.dtype = torch.float64,
) -> nn.Sequential:
    """Integer token ids in, logits out; the head is tied to the embedding."""
    torch.manual_seed(4321)
    emb = nn.Embedding(vocab, width)
    blocks = [Residual(width, dropout) for _ in range(layers - 2)]
    return nn.Sequential(emb, *blocks, TiedHead(emb)).to(dtype)


def token_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch_for(
    model: nn.Sequential, batch: int = 10, seq: int = 3, seed: int = 7
) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    first = next(iter(model.children()))
    dtype = next(model.parameters()).dtype
    if isinstance(first, nn.Embedding):
        x = torch.randint(0, first.num_embeddings, (batch, seq), generator=g)
        y = torch.randint(0, first.num_embeddings, (batch, seq), generator=g)
        return x, y
    width = next(p for p in model.parameters()).shape[-1]
    return torch.randn(batch, width, generator=g, dtype=dtype), torch.randn(
        batch, width, generator=g, dtype=dtype
    )


def has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


def reference(
    model: nn.Sequential,
    x: Tensor,
    y: Tensor,
    loss_fn: LossFn,
    microbatches: int,
    seed: int = 0,
    step: int = 0,
    autocast: torch.dtype | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss and gradients of the plain model; ``model``'s own ``.grad`` is left untouched.

    ``autocast``: each microbatch's forward and loss run under ``torch.autocast`` to that
    dtype on the model's device type, its backward outside it (as the pipeline does);
    rounding then depends on the microbatch, so the model is run microbatch by microbatch.
    """
    saved = {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    state = torch.random.get_rng_state()
    try:
        first = next(model.parameters())
        device = first.device
        if not has_dropout(model) and autocast is None:
            loss = loss_fn(model(x), y)
            loss.backward()
        else:
            total = torch.zeros((), dtype=first.dtype, device=device)
            for i, (xi, yi) in enumerate(
                zip(
                    torch.tensor_split(x, microbatches),
                    torch.tensor_split(y, microbatches),
                    strict=True,
                )
            ):
                with torch.autocast(device.type, dtype=autocast or torch.bfloat16,
                                    enabled=autocast is not None):  # fmt: skip
                    h = xi
                    for k, layer in enumerate(model.children()):
                        seeded(seed, step, i, 1_000_003 + k, device)
                        h = layer(h)
                    li = loss_fn(h, yi)
                li = li * (len(xi) / len(x))
                li.backward()
                total = total + li.detach()
            loss = total
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        torch.random.set_rng_state(state)
        for n, p in model.named_parameters():
            p.grad = saved[n]
    return loss.detach(), grads


def assert_same_gradients(
    params: Iterable[tuple[str, nn.Parameter]], ref: dict[str, Tensor], *, only_owned: bool = False
) -> float:
    """Every parameter's ``.grad`` equals the reference; returns the max abs difference."""
    worst = 0.0
    checked = 0
    for name, p in params:
        if p.grad is None:
            if only_owned:
                continue
            raise AssertionError(f"{name} has no gradient")
        r = ref[name]
        if p.dtype == torch.float64:
            diff = (p.grad - r).abs().max().item()
            assert diff <= 1e-10, f"{name}: max abs difference {diff:.3g} > 1e-10"
        else:
            assert torch.allclose(p.grad, r, rtol=1e-5, atol=1e-6), f"{name}: gradients differ"
            diff = (p.grad - r).abs().max().item()
        worst = max(worst, diff)
        checked += 1
    assert checked > 0, "no parameter was compared"
    return worst


def assert_same_loss(loss: Tensor, ref_loss: Tensor) -> None:
    if ref_loss.dtype == torch.float64:
        assert abs(loss.item() - ref_loss.item()) <= 1e-10, (loss.item(), ref_loss.item())
    else:
        assert torch.allclose(loss.to(ref_loss.dtype), ref_loss, rtol=1e-5, atol=1e-6)


def as_params(grads: dict[str, Tensor]) -> list[tuple[str, nn.Parameter]]:
    """Gradients returned by a rank, as (name, parameter holding it) for assert_same_gradients."""
    params = []
    for name, g in grads.items():
        p = nn.Parameter(torch.empty_like(g))
        p.grad = g
        params.append((name, p))
    return params


def whole_grads(model: nn.Module) -> dict[str, Tensor]:
    """This rank's gradients, each whole (a DTensor gathered over its mesh)."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def worst_errors(
    pipe: object,
    model: nn.Module,
    steps: Iterable[tuple[Callable[[], Tensor], tuple[float, dict[str, Tensor]]]],
    what: str,
) -> dict[str, float]:
    """The largest loss and gradient differences of a pipeline's steps from their references,
    over the parameters this process's stages hold, and how many gradients were compared.

    ``steps``: per step, a call that takes it (returning the loss) and its reference
    ``(loss, gradients by name)``; ``pipe`` is the pipeline whose ``parameters()`` say
    which are this process's.
    """
    mine = {id(p) for p in pipe.parameters()}  # type: ignore[attr-defined]
    worst = {"loss": 0.0, "grad": 0.0, "checked": 0.0}
    for step, (ref_loss, ref_grads) in steps:
        model.zero_grad(set_to_none=True)
        loss = step()
        worst["loss"] = max(worst["loss"], abs(loss.item() - ref_loss))
        for name, p in model.named_parameters():
            if id(p) in mine:
                assert p.grad is not None, f"{what}: {name} has no gradient"
                worst["grad"] = max(worst["grad"], (p.grad - ref_grads[name]).abs().max().item())
                worst["checked"] += 1
    return worst


def no_crash(result: object, where: str) -> None:
    """Fail with the traceback of a case that crashed inside a rank (``{"crashed": text}``)."""
    if isinstance(result, dict) and "crashed" in result:
        import pytest

        pytest.fail(f"{where} crashed inside the rank:\n{result['crashed']}")
