"""A Hugging Face ``config.json`` read as the shape
:class:`~zeropipe.planning.transformer.ModelSpec` prices, or refused in one line naming the file.

The pricing formulas are a dense decoder-only transformer's, so only model types known to be
one are read (:data:`DECODER_TYPES`, each with whether its FFN is gated); an encoder, an
encoder-decoder, a mixture of experts or a type not known here would be priced wrong without
a word, and is refused instead.  A size that is missing, zero, negative or not a whole number
is named with its value.

Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zeropipe.core.errors import ScheduleError

__all__ = ["DECODER_TYPES", "read_hf_config", "spec_fields"]

#: model_type -> whether its FFN is gated (SwiGLU/GeGLU: three matrices; else two)
DECODER_TYPES: dict[str, bool] = {
    "llama": True,
    "mistral": True,
    "qwen2": True,
    "qwen3": True,
    "gemma": True,
    "gemma2": True,
    "gemma3_text": True,
    "phi3": True,
    "olmo": True,
    "olmo2": True,
    "granite": True,
    "gpt2": False,
    "gpt_neox": False,
    "phi": False,
    "starcoder2": False,
}
#: model types that are not decoder-only, said so when refused
_ENCODERS = {"bert", "roberta", "xlm-roberta", "distilbert", "albert", "electra", "deberta",
             "deberta-v2", "modernbert", "camembert", "mpnet", "vit"}  # fmt: skip
_ENCODER_DECODERS = {"t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian", "whisper",
                     "longt5", "led", "blenderbot", "prophetnet"}  # fmt: skip
#: keys that count a mixture of experts' experts (Mixtral, Qwen-MoE, DeepSeek, ...)
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")

# ModelSpec field -> the config keys that may give it (first present wins), and whether
# the field is required; an optional one missing takes ModelSpec's default (see below).
_SIZES: dict[str, tuple[tuple[str, ...], bool]] = {
    "layers": (("num_hidden_layers", "n_layer"), True),
    "hidden": (("hidden_size", "n_embd"), True),
    "heads": (("num_attention_heads", "n_head"), True),
    "kv_heads": (("num_key_value_heads",), False),  # default: heads (no grouped query)
    "ffn": (("intermediate_size", "n_inner"), False),  # default: 4 x hidden
    "vocab": (("vocab_size",), True),
    "head_dim": (("head_dim",), False),  # default: hidden / heads
}


def _whole(value: Any) -> int | None:
    """``value`` as a whole number >= 1, or None (JSON's 4096.0 counts as 4096)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not value.is_integer():
        return None
    return int(value) if value >= 1 else None


def _refuse_kind(config: Mapping[str, Any], where: str) -> None:
    """Refuse what the dense decoder formulas would price wrong: experts, other model types."""
    kind = config.get("model_type")
    for key in _EXPERT_KEYS:
        experts = config.get(key)
        if experts:
            raise ScheduleError(
                f"{where}: model_type {kind!r}: mixture-of-experts configs are not priced yet "
                f"({experts} experts); plan a dense model, or from measured costs "
                f"(zeropipe plan --costs FILE)"
            )
    known = ", ".join(DECODER_TYPES)
    if not isinstance(kind, str) or not kind:
        raise ScheduleError(
            f"{where}: no model_type; the planner prices decoder-only transformers: give "
            f'"model_type" one of {known} (llama: a gated FFN, gpt2: a plain one)'
        )
    if kind not in DECODER_TYPES:
        what = (
            "an encoder"
            if kind in _ENCODERS
            else "an encoder-decoder"
            if kind in _ENCODER_DECODERS
            else "not a decoder-only transformer the planner knows"
        )
        raise ScheduleError(
            f"{where}: model_type {kind!r} is {what}; the planner prices decoder-only "
            f"transformers: {known}"
        )


def spec_fields(config: Mapping[str, Any], *, where: str, name: str) -> dict[str, Any]:
    """:class:`~zeropipe.planning.transformer.ModelSpec`'s keyword arguments from a Hugging Face
    config (Llama-, Mistral-, Qwen-, Gemma-, GPT-2-like: :data:`DECODER_TYPES`); ``where``
    (the file) opens every refusal, ``name`` names the model."""
    _refuse_kind(config, where)
    sizes: dict[str, int] = {}
    missing, bad = [], []
    for field, (keys, required) in _SIZES.items():
        key = next((k for k in keys if config.get(k) is not None), None)
        if key is None:
            if required:
                missing.append(keys[0] + (f" (or {keys[1]})" if len(keys) > 1 else ""))
            continue
        value = _whole(config[key])
        if value is None:
            bad.append(f"{key} = {config[key]!r}")
        else:
            sizes[field] = value
    if missing or bad:
        problems = [f"no {', '.join(missing)}"] if missing else []
        if bad:
            problems.append(f"{', '.join(bad)}: must be whole number{'s' * (len(bad) > 1)} >= 1")
        raise ScheduleError(f"{where}: {'; '.join(problems)}")
    kind = str(config["model_type"])
    return {
        "name": name or kind,
        "layers": sizes["layers"],
        "hidden": sizes["hidden"],
        "heads": sizes["heads"],
        "kv_heads": sizes.get("kv_heads", sizes["heads"]),
        "ffn": sizes.get("ffn", 4 * sizes["hidden"]),
        "vocab": sizes["vocab"],
        "tied_embeddings": bool(config.get("tie_word_embeddings", kind == "gpt2")),
        "gated": DECODER_TYPES[kind],
        "head_dim": sizes.get("head_dim"),
        "source": "Hugging Face config",
    }


def read_hf_config(path: Path) -> dict[str, Any]:
    """:func:`spec_fields` of the ``config.json`` at ``path``, the model named after its folder."""
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ScheduleError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ScheduleError(f"{path} is not a model config (expected a JSON object)")
    return spec_fields(config, where=str(path), name=path.parent.name or path.stem)
