"""``zeropipe.split(model, num_stages)``: a model as a list of stage modules sharing its weights.

    stages = zeropipe.split(model, 4)               # LlamaForCausalLM, GPT2LMHeadModel, Sequential
    pipe = zeropipe.Pipeline(stages, "zbv", microbatches=8, loss_fn=zeropipe.causal_lm_loss)
    opt = torch.optim.AdamW(model.parameters())     # the model's own parameters: nothing copied

What is supported, and how:

    nn.Sequential        consecutive slices, ``balance`` layers per stage (default: even)
    HF causal LMs        zeropipe.adapters.hf: embedding, decoder layers, norm and head;
                         ``balance`` decoder layers per stage (default: by measured time)
    HF mixtures of       zeropipe.adapters.hf_moe: the same stages, which also carry the
      experts            router's statistics when the config asks for its loss
    anything else        refused, naming what to do: cut it into stage modules by hand

Hugging Face models are recognised by their class's module, so transformers is
imported only when such a model is passed.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from zeropipe.adapters.hf import SUPPORTED, hf_family, is_hf_model, split_hf
from zeropipe.adapters.hf_moe import moe_stage_builder
from zeropipe.core.errors import PipelineError
from zeropipe.runtime.step.stage import seed_layers, split_sequential

__all__ = ["split"]


def split(
    model: nn.Module, num_stages: int, *, balance: Sequence[int] | None = None
) -> list[nn.Module]:
    """``model`` cut into ``num_stages`` stage modules for :class:`~zeropipe.Pipeline`.

    The stages hold the model's own submodules: ``model.parameters()``,
    ``model.state_dict()`` and an optimizer over them keep working, and a weight
    tied between two stages (HF ``tie_word_embeddings``) is one ``Parameter`` on
    both, whose gradient the pipeline all-reduces across their ranks.

    ``balance``: layers per stage for an ``nn.Sequential`` (default: as even
    as possible); decoder layers per stage for an HF model (default: cut by the
    measured time of embedding, decoder layer and head; 0 is allowed on the
    first and last stages, which also hold the embedding and the head).
    A stage's input is the previous stage's output; the first takes
    ``input_ids`` and the last returns logits ``[batch, seq, vocab]``.

    Each stage names the index in the whole model of every layer it holds
    (:func:`zeropipe.runtime.step.stage.seed_layers`; for an HF model: the embedding
    0, decoder layer ``i`` ``i + 1``, the head last), by which a pipeline seeds
    the layer's dropout: the masks do not depend on the cut or the schedule.
    A subclass whose ``forward`` differs from the supported class's is refused:
    the stages never call it.
    """
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PipelineError(f"num_stages must be a positive int, got {num_stages!r}")
    if isinstance(model, nn.Sequential):
        # Each slice names its layers' indices in the whole model, so that a Pipeline
        # given the slices seeds them as it seeds a Sequential it cuts itself.
        return [
            seed_layers(stage.module, {str(k): key for k, key in enumerate(stage.layer_keys or ())})
            for stage in split_sequential(model, num_stages, balance)
        ]
    family = hf_family(model)
    if family == "moe":
        return split_hf(model, num_stages, balance, build=moe_stage_builder(model))
    if family is not None:
        return split_hf(model, num_stages, balance)
    what = type(model).__name__
    if is_hf_model(model):
        what = f"the Hugging Face model {what}"
    raise PipelineError(
        f"zeropipe.split cannot cut {what}: it supports nn.Sequential and the Hugging Face "
        f"causal LMs {', '.join(SUPPORTED)}; otherwise pass Pipeline one nn.Module per stage, "
        f"cut by hand (examples/manual_stages.py)"
    )
