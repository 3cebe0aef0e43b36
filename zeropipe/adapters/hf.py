"""Hugging Face decoder-only causal LMs cut into pipeline stages that share the model's weights.

Supported: the Llama family (``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``), ``GPT2LMHeadModel``, and the
mixtures of experts ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM`` and
``DeepseekV3ForCausalLM``, whose llama-like stages :mod:`zeropipe.adapters.hf_moe`
builds.  A stage
holds references to the model's own submodules, never copies::

    stage 0             stage k                  stage p-1
    input_ids           hidden [b, t, d]         hidden
      embed (+ wpe)       layers[i:j]              layers[..]
      layers[0:i]                                  final norm, lm_head -> logits [b, t, vocab]
      -> hidden

Every stage with decoder layers recomputes, from the sequence length alone,
what the model computes once before its layers: the position ids (``0..t-1``,
as the model uses without a cache), the rotary ``(cos, sin)`` (Llama family,
from the model's own ``rotary_emb``) and the causal masks (one per attention
kind the layers use, built by transformers' own ``masking_utils`` for the
configured attention implementation).  So only the hidden states cross stages.
Tied embeddings stay tied: the last stage's ``lm_head.weight`` *is* the first
stage's embedding weight, which the pipeline finds on two stages and whose
gradient it all-reduces when they sit on different ranks.

Padding: a pipeline whose inputs are ``(input_ids, attention_mask)`` (mask
``[batch, seq]``, 1 = token, 0 = padding) gets stages that take and pass on
``(hidden, attention_mask)`` (the mask as bool); each builds the 4-D masks from it as the model
does, and the last returns the logits only.  Position ids stay ``0..t-1`` in
padded rows too, as the model computes them (label pads ``-100``).  Without a
mask only the hidden states cross stages.

Packed documents: a dict batch (``pipe.step({"input_ids": ..., "position_ids": ...},
labels)``, the model's own keyword names; ``attention_mask`` may join them) passes the
position ids on; positions that restart mark the documents of a row, and each stage builds
the mask transformers builds for them (attention never crosses a document: without an
attention mask and without a cache, transformers reads packed rows from the position ids)
and the rotary positions of each document.  Between stages a bool ``[batch, seq]`` tensor
is the padding mask and an integer one the position ids.

transformers is imported here only, and only when a model of it is passed;
the internals used were checked on transformers 5.24 and need
``transformers.masking_utils`` (4.53 or later).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from zeropipe.core.errors import PipelineError
from zeropipe.planning.balance import balance as balance_times
from zeropipe.runtime.step.stage import seed_layers

__all__ = [
    "SUPPORTED",
    "LlamaStage",
    "StageBuilder",
    "hf_family",
    "is_hf_model",
    "llama_stage",
    "split_hf",
]

# Class name -> how its stages are built.
SUPPORTED: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
    # Mixtures of experts: llama-like decoders whose stages also carry the router's
    # statistics when the config asks for its loss (zeropipe.adapters.hf_moe builds them).
    "Qwen3MoeForCausalLM": "moe",
    "MixtralForCausalLM": "moe",
    "DeepseekV3ForCausalLM": "moe",
}
StageBuilder = Callable[[nn.Module, list[int], bool, bool], nn.Module]
_CHECKED = "checked on transformers 5.24; needs 4.53 or later (transformers.masking_utils)"
# The stages call the model's submodules (embedding, decoder layers, norm, head) themselves,
# so these methods of the model and of its inner model never run: a subclass that changes
# one would be split as its base class.
_BYPASSED = ("forward", "__call__")


def is_hf_model(model: object) -> bool:
    """Whether ``model`` is (a subclass of) a transformers class; transformers is not imported."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def hf_family(model: object) -> str | None:
    """``"llama"``, ``"gpt2"`` or ``"moe"`` for a supported HF model (or a subclass of one),
    else None."""
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__ in SUPPORTED:
            return SUPPORTED[cls.__name__]
    return None


def split_hf(
    model: nn.Module,
    num_stages: int,
    balance: Sequence[int] | None,
    sample_len: int = 32,
    build: StageBuilder | None = None,
) -> list[nn.Module]:
    """``model`` cut into ``num_stages`` stage modules; ``balance`` = decoder layers per stage.

    ``build(model, layer_indices, first, last)`` makes one stage: by default the
    family's own (mixtures of experts pass zeropipe.adapters.hf_moe's).  Without ``balance`` the embedding, every decoder layer and the head are
    timed (forward + backward on a sample of ``sample_len`` tokens) and cut so
    that the slowest stage is as fast as can be; in a distributed job rank 0's
    cut is broadcast so that every rank builds the same stages.
    """
    family = hf_family(model)
    if family is None:
        raise PipelineError(f"{type(model).__name__} is not one of {', '.join(SUPPORTED)}")
    build = build or {"llama": llama_stage, "gpt2": _gpt2_stage}.get(family)
    if build is None:
        raise PipelineError(
            f"{type(model).__name__} is a mixture of experts: cut it with zeropipe.split, "
            f"which builds its stages with zeropipe.adapters.hf_moe"
        )
    _check_not_overridden(model, family)
    layers = _layers(model, family)
    if balance is None:
        cut = _measured_cut(model, build, len(layers), num_stages, sample_len)
    else:
        cut = _checked_cut(list(balance), len(layers), num_stages)
    stages, start = [], 0
    for s, count in enumerate(cut):
        picked = list(range(start, start + count))
        stage = build(model, picked, s == 0, s == num_stages - 1)
        stages.append(seed_layers(stage, _layer_keys(stage, picked, len(layers))))
        start += count
    return stages


def _layer_keys(stage: nn.Module, picked: list[int], layers: int) -> dict[str, int]:
    """Each unit seeded by its index in the whole model: the embedding 0, decoder layer
    ``i`` ``i + 1``, the head ``layers + 1``; so dropout does not depend on the cut.

    A unit is keyed by the submodule it runs first (the embedding unit of GPT-2 draws
    its dropout after ``wte`` and ``wpe``, as the model does).
    """
    names = [n for n, _ in stage.named_children()]
    keys = {f"layers.{k}": i + 1 for k, i in enumerate(picked)}
    first = next((n for n in ("embed_tokens", "wte") if n in names), None)
    head = next((n for n in ("norm", "ln_f") if n in names), None)
    if first is not None:
        keys[first] = 0
    if head is not None:
        keys[head] = layers + 1
    return keys


def _check_not_overridden(model: nn.Module, family: str) -> None:
    """Refuse a model whose own forward (or its inner model's) is not the supported class's."""
    cls = type(model)
    base = next(
        c
        for c in cls.__mro__
        if c.__module__.startswith("transformers.") and c.__name__ in SUPPORTED
    )
    attr = "transformer" if family == "gpt2" else "model"
    inner = getattr(model, attr, None)
    parts: list[tuple[nn.Module, type, str]] = [(model, base, cls.__name__)]
    if isinstance(inner, nn.Module):
        want = "GPT2Model" if family == "gpt2" else base.__name__.replace("ForCausalLM", "Model")
        inner_base = next(
            (
                c
                for c in type(inner).__mro__
                if c.__module__.startswith("transformers.") and c.__name__ == want
            ),
            None,
        )
        if inner_base is None:
            raise PipelineError(
                f"zeropipe.split cannot cut {cls.__name__}: its .{attr} is a "
                f"{type(inner).__name__}, not transformers' {want}, and the stages rebuild "
                f"{want}'s forward; cut it into stage modules by hand (examples/manual_stages.py)"
            )
        parts.append((inner, inner_base, f"{cls.__name__}.{attr}"))
    for obj, supported, what in parts:
        changed = [n for n in _BYPASSED if n in vars(obj)]
        changed += [
            n for n in _BYPASSED if getattr(type(obj), n, None) is not getattr(supported, n, None)
        ]
        if changed:
            raise PipelineError(
                f"zeropipe.split cannot cut {cls.__name__}: {what} overrides {changed[0]} of "
                f"transformers' {supported.__name__}, which its stages never call (they run the "
                f"embedding, decoder layers, norm and head themselves), so the change would be "
                f"lost; cut it into stage modules by hand (examples/manual_stages.py)"
            )
    _check_loss_not_overridden(model, base)


def _check_loss_not_overridden(model: nn.Module, base: type) -> None:
    """Refuse a model whose ``.loss`` is not transformers' causal-LM loss: its forward computes
    it with ``self.loss_function`` (an override of it, one set on the model, or a
    ``loss_type`` naming another), but the pipeline computes the loss with its own loss_fn."""
    name = type(model).__name__
    why = ""
    if "loss_function" in vars(model) or "_loss_function" in vars(model):
        why = "sets loss_function on the model"
    elif getattr(type(model), "loss_function", None) is not getattr(base, "loss_function", None):
        why = f"overrides loss_function of transformers' {base.__name__}"
    elif hasattr(type(model), "_loss_function"):
        why = "sets _loss_function (its loss_function)"
    elif getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        why = f"sets loss_type={model.loss_type!r} (not 'ForCausalLM')"
    if why:
        raise PipelineError(
            f"zeropipe.split cannot cut {name}: it {why}, which computes the model's own .loss, "
            f"but the pipeline computes the loss with the loss_fn it is given, so the change "
            f"would be silently ignored; pass Pipeline(loss_fn=...) a loss_fn that computes it, "
            f"and split a plain {base.__name__} holding the same weights"
        )


# -- the stages -------------------------------------------------------------------------
class _DecoderStage(nn.Module):
    """Embedding (first stage), a run of decoder layers, final norm and head (last stage)."""

    def __init__(self, config: Any, layers: list[nn.Module], kinds: list[str]) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers)
        self.kinds = kinds  # per layer: "full_attention" or "sliding_attention"
        self.first = self.last = False
        self.context_parallel: Any = None  # this rank's share of the sequence (context_parallel.py)

    def forward(self, *inputs: Tensor, **named: Tensor) -> Tensor | tuple[Tensor, ...]:
        x, pad, pos = self._unpack(inputs, named) if named else self._unpack_positional(inputs)
        shards = self.context_parallel
        if shards is not None:  # the rank's tokens, with their positions in the whole sequence
            x, pos = shards.local(x, pad, pos, self.first)
        h = self.embed(x, pos) if self.first else x
        if len(self.layers):
            at = pos if pos is not None else torch.arange(h.shape[1], device=h.device)[None]
            build = _mask if shards is None else shards.mask
            masks = {k: build(k, self.config, h, at, pad) for k in set(self.kinds)}
            h = self.run_layers(h, at, masks)
        if self.last:
            return self.head(h)
        passed = tuple(t for t in (pad, pos) if t is not None)
        return (h, *passed) if passed else h

    def _unpack(
        self, inputs: tuple[Tensor, ...], named: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The first stage's keyword inputs, as the model takes them: ``input_ids``, and
        optionally ``attention_mask`` and ``position_ids`` (positions that restart mark the
        documents of a packed row, which attention never crosses when there is no mask)."""
        unknown = sorted(set(named) - {"input_ids", "attention_mask", "position_ids"})
        if not self.first or inputs or "input_ids" not in named or unknown:
            raise PipelineError(
                f"a split Hugging Face model takes a dict batch of input_ids and optionally "
                f"attention_mask and position_ids, on its first stage only; got "
                f"{sorted(named)}" + (f" ({', '.join(unknown)} unknown)" if unknown else "")
            )
        ids, mask = named["input_ids"], named.get("attention_mask")
        x, pad, _ = self._unpack_positional((ids,) if mask is None else (ids, mask))
        return x, pad, _positions(named.get("position_ids"), x)

    def _unpack_positional(
        self, inputs: tuple[Tensor, ...]
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(input_ids | hidden, attention_mask?, position_ids?)``, checked.  Between stages
        a bool ``[batch, seq]`` tensor is the padding mask, an integer one the positions."""
        x = inputs[0] if inputs else None
        rest = inputs[1:]
        if (
            isinstance(x, Tensor)
            and len(rest) <= (1 if self.first else 2)
            and x.dim() >= 2
            and x.is_floating_point() != self.first
            and all(isinstance(t, Tensor) and t.shape == x.shape[:2] for t in rest)
        ):
            if self.first:
                pad = rest[0] if rest else None
                if pad is not None and pad.dtype != torch.bool:
                    pad = pad != 0  # what transformers makes of a 2-D mask; a bool crosses stages
                return x, pad, None
            pad = next((t for t in rest if t.dtype == torch.bool), None)
            pos = next((t for t in rest if t.dtype != torch.bool), None)
            return x, pad, pos
        got = ", ".join(
            f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
            if isinstance(t, Tensor)
            else type(t).__name__
            for t in inputs
        )
        where = "the first stage" if self.first else "a stage"
        x_name = "input_ids" if self.first else "hidden"
        takes = "(integer token ids [batch, seq])" if self.first else "(float [batch, seq, dim])"
        raise PipelineError(
            f"{where} of a split Hugging Face model takes {x_name} only {takes} or "
            f"({x_name}, attention_mask [batch, seq]; 1 = token, 0 = padding), or a dict "
            f"batch with position_ids, got {len(inputs)} tensor(s): {got}"
        )

    def embed(self, ids: Tensor, pos: Tensor | None) -> Tensor:
        raise NotImplementedError

    def head(self, h: Tensor) -> Tensor:
        raise NotImplementedError

    def run_layers(self, h: Tensor, pos: Tensor, masks: dict[str, Any]) -> Tensor:
        raise NotImplementedError


class LlamaStage(_DecoderStage):
    """A stage of a Llama-family decoder: rotary embeddings recomputed, no bias in the head."""

    embed_tokens: nn.Module
    rotary_emb: nn.Module
    norm: nn.Module
    lm_head: nn.Module

    def embed(self, ids: Tensor, pos: Tensor | None) -> Tensor:
        return self.embed_tokens(ids)

    def head(self, h: Tensor) -> Tensor:
        return self.lm_head(self.norm(h))

    def run_layers(self, h: Tensor, pos: Tensor, masks: dict[str, Any]) -> Tensor:
        cos_sin = self.rotary_emb(h, pos)
        for layer, kind in zip(self.layers, self.kinds, strict=True):
            out = layer(
                h,
                attention_mask=masks[kind],
                position_ids=pos,
                position_embeddings=cos_sin,
                use_cache=False,
            )
            h = _hidden(out)
        return h


class _GPT2Stage(_DecoderStage):
    wte: nn.Module
    wpe: nn.Module
    drop: nn.Module
    ln_f: nn.Module
    lm_head: nn.Module

    def embed(self, ids: Tensor, pos: Tensor | None) -> Tensor:
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(pos))

    def head(self, h: Tensor) -> Tensor:
        return self.lm_head(self.ln_f(h))

    def run_layers(self, h: Tensor, pos: Tensor, masks: dict[str, Any]) -> Tensor:
        for block, kind in zip(self.layers, self.kinds, strict=True):
            h = _hidden(block(h, attention_mask=masks[kind], use_cache=False))
        return h


def llama_stage(
    hf: nn.Module,
    picked: list[int],
    first: bool,
    last: bool,
    stage_class: type[LlamaStage] = LlamaStage,
) -> LlamaStage:
    """The stage of ``hf`` holding decoder layers ``picked`` (and the embedding if ``first``,
    norm and head if ``last``), as a ``stage_class``."""
    model: Any = hf
    inner: Any = model.model
    config = model.config
    types = getattr(config, "layer_types", None)
    if types is None:  # Mistral: one window for every layer, when the config sets one
        kind = "full_attention" if getattr(config, "sliding_window", None) is None else "sliding"
        types = ["sliding_attention" if kind == "sliding" else kind] * len(inner.layers)
    stage = stage_class(config, [inner.layers[i] for i in picked], [types[i] for i in picked])
    if picked:
        stage.rotary_emb = inner.rotary_emb  # buffers only, shared by the stages
    if first:
        stage.first, stage.embed_tokens = True, inner.embed_tokens
    if last:
        stage.last, stage.norm, stage.lm_head = True, inner.norm, model.lm_head
    return stage


def _gpt2_stage(hf: nn.Module, picked: list[int], first: bool, last: bool) -> nn.Module:
    model: Any = hf
    inner: Any = model.transformer
    stage = _GPT2Stage(model.config, [inner.h[i] for i in picked], ["full_attention"] * len(picked))
    if first:
        stage.first, stage.wte, stage.wpe, stage.drop = True, inner.wte, inner.wpe, inner.drop
    if last:
        stage.last, stage.ln_f, stage.lm_head = True, inner.ln_f, model.lm_head
    return stage


def _layers(model: nn.Module, family: str) -> nn.ModuleList:
    """The decoder layers, after checking the model has the parts the stages use."""
    need = (
        ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")
        if family != "gpt2"
        else ("transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head")
    )
    for path in need:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            raise PipelineError(
                f"{type(model).__name__} has no {path} in transformers {_version()}; "
                f"zeropipe.split's adapter was {_CHECKED}: install such a version or pass "
                f"stages by hand"
            )
    inner: Any = model.transformer if family == "gpt2" else model.model
    return inner.h if family == "gpt2" else inner.layers


def _hidden(out: object) -> Tensor:
    """A decoder layer's hidden states: transformers 5 returns them, 4.x a tuple led by them."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], Tensor):
        return out[0]
    raise PipelineError(
        f"a decoder layer returned {type(out).__name__}, not hidden states; "
        f"zeropipe.split's adapter was {_CHECKED}"
    )


# -- masks ------------------------------------------------------------------------------
def _positions(pos: Tensor | None, ids: Tensor) -> Tensor | None:
    """The caller's ``position_ids``, checked: integers, one per token of ``ids``."""
    if pos is None:
        return None
    if pos.is_floating_point() or pos.dtype == torch.bool or pos.shape != ids.shape[:2]:
        raise PipelineError(
            f"position_ids must be integers shaped like input_ids {list(ids.shape[:2])}, got "
            f"{str(pos.dtype).removeprefix('torch.')} {list(pos.shape)}"
        )
    return pos.long()


def _mask(kind: str, config: Any, h: Tensor, pos: Tensor, pad: Tensor | None = None) -> Any:
    """The causal mask of ``kind`` for hidden states ``h`` and the padding mask ``pad``
    (``[batch, seq]``, 1 = token, 0 = padding, or None), built as the model builds it."""
    fn, embeds, cache, cache_position = _mask_fn(kind)
    kwargs: dict[str, Any] = {
        "config": config,
        embeds: h,
        "attention_mask": pad,
        cache: None,
        "position_ids": pos,
    }
    if cache_position:  # older releases take the cache positions too
        kwargs["cache_position"] = pos[0]
    return fn(**kwargs)


@functools.cache
def _mask_fn(kind: str) -> tuple[Callable[..., Any], str, str, bool]:
    """The mask function, the names of its embeddings and cache arguments (``input_embeds``
    and ``past_key_values`` in older releases, renamed since: the old cache name is deprecated
    in 5.24), and whether it takes ``cache_position`` (older releases)."""
    try:
        from transformers import masking_utils
    except ImportError:
        raise PipelineError(
            f"transformers {_version()} has no masking_utils; zeropipe.split's adapter was "
            f"{_CHECKED}: pip install -U 'zeropipe[hf]'"
        ) from None
    name = "create_causal_mask" if kind == "full_attention" else "create_sliding_window_causal_mask"
    fn = getattr(masking_utils, name, None)
    if fn is None:
        raise PipelineError(f"transformers {_version()} lacks masking_utils.{name}; {_CHECKED}")
    params = inspect.signature(fn).parameters
    embeds = "inputs_embeds" if "inputs_embeds" in params else "input_embeds"
    cache = "cache" if "cache" in params else "past_key_values"
    return fn, embeds, cache, "cache_position" in params


def _version() -> str:
    try:
        import transformers
    except ImportError:
        return "(not installed)"
    return str(transformers.__version__)


# -- the cut ----------------------------------------------------------------------------
def _checked_cut(cut: list[int], layers: int, num_stages: int) -> list[int]:
    ok = len(cut) == num_stages and sum(cut) == layers and min(cut, default=0) >= 0
    # A middle stage without layers would have nothing to run.
    ok = ok and all(c > 0 for c in cut[1:-1])
    if not ok:
        raise PipelineError(
            f"balance {cut} must give {num_stages} decoder-layer counts summing to the model's "
            f"{layers} layers (0 allowed only on the first or last stage, which hold the "
            f"embedding and the head)"
        )
    return cut


def _measured_cut(
    model: nn.Module,
    build: StageBuilder,
    layers: int,
    num_stages: int,
    sample_len: int,
) -> list[int]:
    """Decoder layers per stage, from measured times of embedding, one layer and head."""
    if layers + 2 < num_stages:
        raise PipelineError(
            f"{type(model).__name__} has {layers} decoder layer(s), too few for {num_stages} "
            f"stages; use fewer stages (ranks x chunks) or a deeper model"
        )
    # A tensor-parallel model's layers run collectives over "tp": every rank times them.
    everywhere = any(_is_dtensor(p) for p in model.parameters())
    cut = _agreed(lambda: _time_and_cut(model, build, layers, num_stages, sample_len), everywhere)
    return _checked_cut(cut, layers, num_stages)


def _time_and_cut(
    model: nn.Module,
    build: StageBuilder,
    layers: int,
    num_stages: int,
    sample_len: int,
) -> list[int]:
    param = next(model.parameters())
    config = cast(Any, model).config
    positions = getattr(config, "max_position_embeddings", None) or getattr(
        config, "n_positions", None
    )
    length = min(sample_len, int(positions)) if positions else sample_len
    ids = torch.randint(0, int(config.vocab_size), (1, length), device=param.device)
    kept = {id(p): p.grad for p in model.parameters()}  # the caller's gradients, put back
    embed = build(model, [], True, False)
    one = build(model, [0], False, False)
    head = build(model, [], False, True)
    with torch.no_grad():
        hidden = embed(ids)
    t_embed = _timed(embed, ids)
    t_layer = _timed(one, hidden)
    t_head = _timed(head, hidden)
    for p in model.parameters():  # the timing's backward leaves nothing behind
        p.grad = kept[id(p)]
    units = balance_times([t_embed, *[t_layer] * layers, t_head], num_stages)
    cut = list(units)
    cut[0] -= 1  # the embedding unit
    cut[-1] -= 1  # the head unit
    if num_stages == 1:
        cut = [layers]
    return cut


def _timed(module: nn.Module, x: Tensor | tuple[Tensor, ...], repeat: int = 3) -> float:
    """The median time of a forward and backward of ``module`` on ``x`` (a stage's input,
    one tensor or several: hidden states and what crosses beside them)."""
    times = []
    given = x if isinstance(x, tuple) else (x,)
    for _ in range(repeat + 1):
        inp = [t.detach().requires_grad_(True) if t.is_floating_point() else t for t in given]
        t0 = time.perf_counter()
        out = module(*inp)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[repeat // 2]


def _is_dtensor(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _agreed(compute: Callable[[], list[int]], everywhere: bool = False) -> list[int]:
    """Rank 0's result in a distributed job (measured times differ between processes);
    ``everywhere``: every rank computes (the computation runs collectives), rank 0's is kept."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return compute()
    mine = compute() if everywhere or dist.get_rank() == 0 else None
    box: list[Any] = [mine if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return list(box[0])
