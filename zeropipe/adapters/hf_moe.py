"""Hugging Face mixtures of experts cut into pipeline stages, with the router's loss exact.

Supported: ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM`` and
``DeepseekV3ForCausalLM`` (dense first blocks, shared experts, MLA attention,
the router's score-correction bias), with any experts implementation of the
model (``eager``, ``batched_mm``, ``grouped_mm``; torch's grouped_mm takes
no float64).  Their decoders are
llama-like, so a stage is a :class:`~zeropipe.adapters.hf.LlamaStage`: it runs
the model's own decoder layers, whose MoE blocks route, run the experts and
add the shared experts themselves.

The router's load-balancing loss.  When the config asks for it
(``output_router_logits=True``) Mixtral and Qwen3-MoE add to their loss
``router_aux_loss_coef * aux``, with ``aux`` transformers'
``load_balancing_loss_func`` over the router logits of *every* MoE layer::

    aux = E * sum_e  (selected[e] / rows) * (probability[e] / rows)

where ``selected[e]`` sums, over layers and tokens, how often expert ``e`` is
among a token's top-k, ``probability[e]`` sums its softmax probability, and
``rows`` is layers x tokens (padding excluded).  Both sums run over layers, so
each stage adds its layers' sums, in the layers' order and in float32 as
transformers does, to a ``[2, E]`` tensor that crosses to the next stage
beside the hidden states (the probability row carries gradient)::

    stage 0                  stage k                      stage p-1
    ids -> (h, stats)        (h, stats) -> (h, stats)     (h, stats) -> (logits, coef * aux)

The last stage returns ``(logits, coef * aux)``; ``zeropipe.causal_lm_loss``
takes that pair and hands the pipeline ``(ce_sum, count, coef * aux)``, which it
turns into ``ce_sum / counted tokens + coef * aux / microbatches`` (see
:mod:`zeropipe.runtime.step.loss_contract`).  The router logits are read as
transformers reads them: a forward hook on the router class its
``_can_record_outputs["router_logits"]`` names.  DeepSeek-V3 computes no
load-balancing loss in transformers (its routing is balanced by the
score-correction bias, updated outside the gradient): its stages add nothing,
whatever ``output_router_logits`` says.  The config is read when the model is
split: setting ``output_router_logits`` later needs a new split.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import Tensor, nn

from zeropipe.adapters.hf import LlamaStage, StageBuilder, hf_family, llama_stage
from zeropipe.core.errors import PipelineError

__all__ = ["MOE_FAMILIES", "MoEStage", "RouterLoss", "moe_stage_builder", "router_loss"]

# Class name -> whether transformers adds a load-balancing loss to its loss.
MOE_FAMILIES: dict[str, bool] = {
    "Qwen3MoeForCausalLM": True,
    "MixtralForCausalLM": True,
    "DeepseekV3ForCausalLM": False,
}


class RouterLoss:
    """What the stages need to add up a model's load-balancing loss, read from the model.

    ``router``: the class whose output ``index`` is a layer's router logits
    ``[tokens, experts]``; ``layers``: how many such routers the whole model has.
    """

    def __init__(self, model: nn.Module) -> None:
        hf: Any = model
        recorders = getattr(type(model), "_can_record_outputs", None) or {}
        recorder = recorders.get("router_logits")
        name = type(model).__name__
        if recorder is None or not isinstance(getattr(recorder, "target_class", None), type):
            raise PipelineError(
                f"{name} asks for its router's loss (output_router_logits=True) but its "
                f"transformers class records no router logits (_can_record_outputs); set "
                f"output_router_logits=False, or cut the model into stages by hand"
            )
        self.router: type = recorder.target_class
        self.index = int(getattr(recorder, "index", 0) or 0)
        self.experts = int(hf.num_experts)
        self.top_k = int(hf.num_experts_per_tok)
        self.coef = float(hf.router_aux_loss_coef)
        self.layers = sum(isinstance(m, self.router) for m in hf.model.layers.modules())
        if self.layers == 0:
            raise PipelineError(f"{name} has no {self.router.__name__} in its decoder layers")

    def zeros(self, device: torch.device) -> Tensor:
        """The running sums before the first layer: row 0 selections, row 1 probabilities."""
        return torch.zeros(2, self.experts, dtype=torch.float32, device=device)

    def add_layer(self, stats: Tensor, logits: Tensor, pad: Tensor | None) -> Tensor:
        """``stats`` plus one layer's sums, as ``load_balancing_loss_func`` adds them."""
        routing = torch.softmax(logits.to(stats.device), dim=-1)
        _, selected = torch.topk(routing, self.top_k, dim=-1)
        if pad is None:
            # transformers counts with histc: float on CPU and MPS, int32 elsewhere.
            kind = torch.float32 if stats.device.type in ("cpu", "mps") else torch.int32
            picked = torch.histc(
                selected.reshape(-1).to(kind), bins=self.experts, min=0, max=self.experts
            )
            probs = routing.float().sum(dim=0)
        else:
            flat = _flat(pad, stats.device)
            picked = torch.zeros(self.experts, dtype=torch.float32, device=stats.device)
            picked = picked.scatter_add_(
                0, selected.reshape(-1), flat.repeat_interleave(self.top_k)
            )
            probs = (routing.float() * flat.unsqueeze(-1)).sum(dim=0)
        return stats + torch.stack([picked.float(), probs])

    def aux(self, stats: Tensor, rows: int, pad: Tensor | None) -> Tensor:
        """The load-balancing loss of the whole model from the sums of all its layers."""
        total: Any = 0.0
        for _ in range(self.layers):  # the rows every layer adds, summed as transformers does
            total = total + (rows if pad is None else _flat(pad, stats.device).sum())
        per_expert = stats[0] / total
        probability = stats[1] / total
        return torch.sum(per_expert * probability.unsqueeze(0)) * self.experts


def router_loss(model: nn.Module) -> RouterLoss | None:
    """The load-balancing loss ``model``'s stages add up, or None when its loss has none
    (``output_router_logits`` off, or a family without one such as DeepSeek-V3)."""
    config: Any = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    family = next(
        (
            MOE_FAMILIES[c.__name__]
            for c in type(model).__mro__
            if c.__module__.startswith("transformers.") and c.__name__ in MOE_FAMILIES
        ),
        False,
    )
    return RouterLoss(model) if family else None


class MoEStage(LlamaStage):
    """A llama-like stage that also adds its routers' statistics to the running sums.

    Without a router loss it is a :class:`~zeropipe.adapters.hf.LlamaStage`.
    With one, every stage but the first takes the sums as its last input, every
    stage but the last passes them on as its last output, and the last returns
    ``(logits, coef * aux)`` (module docstring).
    """

    balance: RouterLoss | None = None

    def forward(self, *inputs: Tensor, **named: Tensor) -> Tensor | tuple[Tensor, ...]:
        balance = self.balance
        if balance is None:
            return super().forward(*inputs, **named)
        rest, stats = self._split_stats(inputs, balance)
        routers = [m for m in self.layers.modules() if isinstance(m, balance.router)]
        with _recorded(routers, balance.index) as logits:
            out = super().forward(*rest, **named)
        # The stage's ids or hidden states and its padding mask, read as the base stage reads
        # them (a bool [batch, seq] between stages; an integer one is the position ids).
        x, pad, _ = self._unpack(rest, named) if named else self._unpack_positional(rest)
        if stats is None:
            stats = balance.zeros(x.device)
        for one in logits:
            stats = balance.add_layer(stats, one, pad)
        if self.last:
            assert isinstance(out, Tensor)  # the last stage returns the logits alone
            kind = torch.promote_types(out.dtype, torch.float32)
            aux = balance.aux(stats, x.shape[0] * x.shape[1], pad)
            return out, balance.coef * aux.to(kind)
        return (*out, stats) if isinstance(out, tuple) else (out, stats)

    def _split_stats(
        self, inputs: tuple[Tensor, ...], balance: RouterLoss
    ) -> tuple[tuple[Tensor, ...], Tensor | None]:
        """The inputs a LlamaStage takes, and the running sums (None on the first stage)."""
        if self.first:
            return inputs, None
        stats = inputs[-1] if inputs else None
        if not isinstance(stats, Tensor) or stats.shape != (2, balance.experts):
            got = list(stats.shape) if isinstance(stats, Tensor) else type(stats).__name__
            raise PipelineError(
                f"a stage of a split mixture of experts whose router loss is on "
                f"(output_router_logits=True) takes (hidden, [attention_mask,] [position_ids,] "
                f"router sums [2, {balance.experts}]), the previous stage's outputs; its last "
                f"input is {got}"
            )
        return inputs[:-1], stats


def moe_stage_builder(model: nn.Module) -> StageBuilder:
    """How ``zeropipe.split`` builds each stage of the mixture of experts ``model``."""
    if hf_family(model) != "moe":
        raise PipelineError(f"{type(model).__name__} is not one of {', '.join(MOE_FAMILIES)}")
    balance = router_loss(model)

    def build(hf: nn.Module, picked: list[int], first: bool, last: bool) -> nn.Module:
        stage = llama_stage(hf, picked, first, last, stage_class=MoEStage)
        assert isinstance(stage, MoEStage)
        stage.balance = balance
        return stage

    return build


@contextlib.contextmanager
def _recorded(routers: list[nn.Module], index: int) -> Iterator[list[Tensor]]:
    """The router logits ``routers`` produce in this thread while the block runs, in order."""
    got: list[Tensor] = []
    me = threading.get_ident()

    def hook(module: nn.Module, args: object, output: object) -> None:
        if threading.get_ident() == me:  # another thread's forward of the same layer
            got.append(cast(Tensor, output[index] if isinstance(output, tuple) else output))

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def _flat(pad: Tensor, device: torch.device) -> Tensor:
    return pad.reshape(-1).to(device=device, dtype=torch.float32)
