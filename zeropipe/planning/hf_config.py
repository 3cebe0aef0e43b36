"""A Hugging Face ``config.json`` read as the shape
:class:`~zeropipe.planning.pricing.transformer.ModelSpec` prices, or refused in one line naming the file.

The pricing formulas are a decoder-only transformer's, so only model types known to be
one are read (:data:`DECODER_TYPES`, each with whether its FFN is gated), and the mixtures of
experts whose routing the planner prices (:data:`MOE_TYPES`: Qwen3-MoE, Mixtral, DeepSeek-V2
and V3, the latter two with multi-head latent attention); an encoder, an encoder-decoder,
another mixture of experts or a type not known here would be priced wrong without a word,
and is refused instead.  A size that is missing, zero, negative or not a whole number is
named with its value.

Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zeropipe.core.errors import ScheduleError

__all__ = ["DECODER_TYPES", "MOE_TYPES", "read_hf_config", "spec_fields"]

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
#: mixture-of-experts model_type -> its config keys for (routed experts, shared experts,
#: expert FFN width); None: it has none (Mixtral: no shared experts, intermediate_size wide)
MOE_TYPES: dict[str, tuple[str, str | None, str]] = {
    "qwen3_moe": ("num_experts", None, "moe_intermediate_size"),
    "mixtral": ("num_local_experts", None, "intermediate_size"),
    "deepseek_v2": ("n_routed_experts", "n_shared_experts", "moe_intermediate_size"),
    "deepseek_v3": ("n_routed_experts", "n_shared_experts", "moe_intermediate_size"),
}
#: latent-attention keys (DeepSeek), as MLAShape's fields; q_lora_rank may be null (none)
_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
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
    if kind in MOE_TYPES:
        return
    for key in _EXPERT_KEYS:
        experts = config.get(key)
        if experts:
            raise ScheduleError(
                f"{where}: model_type {kind!r} has {key} = {experts!r}: its mixture of experts "
                f"is not priced (priced: {', '.join(MOE_TYPES)}); plan from measured costs "
                f"(zeropipe plan --costs FILE)"
            )
    known = ", ".join([*DECODER_TYPES, *MOE_TYPES])
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
    """:class:`~zeropipe.planning.pricing.transformer.ModelSpec`'s keyword arguments from a Hugging Face
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
    moe = _moe_fields(config, kind, sizes["layers"], where) if kind in MOE_TYPES else {}
    return moe | {
        "name": name or kind,
        "layers": sizes["layers"],
        "hidden": sizes["hidden"],
        "heads": sizes["heads"],
        "kv_heads": sizes.get("kv_heads", sizes["heads"]),
        "ffn": sizes.get("ffn", 4 * sizes["hidden"]),
        "vocab": sizes["vocab"],
        "tied_embeddings": bool(config.get("tie_word_embeddings", kind == "gpt2")),
        "gated": DECODER_TYPES.get(kind, True),
        "head_dim": sizes.get("head_dim"),
        "source": "Hugging Face config",
    }


def _size(config: Mapping[str, Any], key: str, where: str, *, least: int = 1) -> int:
    """``config[key]``, a whole number >= ``least``, or a refusal naming the key."""
    value = config.get(key)
    whole = _whole(value) if least >= 1 else (0 if value in (0, None) else _whole(value))
    if whole is None or whole < least:
        what = "no " + key if value is None else f"{key} = {value!r}"
        raise ScheduleError(
            f"{where}: {what}: a mixture of experts needs a whole number >= {least}"
        )
    return whole


def _moe_fields(config: Mapping[str, Any], kind: str, layers: int, where: str) -> dict[str, Any]:
    """The experts of a :data:`MOE_TYPES` config, which blocks are dense, and (DeepSeek) its
    latent attention, as ModelSpec's keyword arguments."""
    experts_key, shared_key, width_key = MOE_TYPES[kind]
    out: dict[str, Any] = {
        "experts": _size(config, experts_key, where),
        "experts_per_token": _size(config, "num_experts_per_tok", where),
        "expert_ffn": _size(config, width_key, where),
        "shared_experts": _size(config, shared_key, where, least=0) if shared_key else 0,
    }
    if kind == "qwen3_moe":  # HF: experts where (i + 1) % decoder_sparse_step == 0, not listed
        step = _size(config, "decoder_sparse_step", where) if "decoder_sparse_step" in config else 1
        listed = config.get("mlp_only_layers") or []
        if not isinstance(listed, list) or not all(_whole(b) is not None or b == 0 for b in listed):
            raise ScheduleError(
                f"{where}: mlp_only_layers = {listed!r}: give a list of block indices"
            )
        out["dense_blocks"] = [b for b in range(layers) if b in listed or (b + 1) % step]
    elif kind.startswith(
        "deepseek"
    ):  # HF: experts from first_k_dense_replace, every moe_layer_freq
        first = _size(config, "first_k_dense_replace", where, least=0)
        freq = _size(config, "moe_layer_freq", where) if "moe_layer_freq" in config else 1
        out["dense_blocks"] = [b for b in range(layers) if b < first or b % freq]
        if config.get("n_group") and config.get("topk_group"):  # group-limited routing
            out["expert_groups"] = _size(config, "n_group", where)
            out["groups_per_token"] = _size(config, "topk_group", where)
        out["mla"] = {
            key: _size(config, key, where, least=0 if key == "q_lora_rank" else 1)
            for key in _MLA_KEYS
        }
    if out["experts_per_token"] > out["experts"]:
        raise ScheduleError(
            f"{where}: num_experts_per_tok = {out['experts_per_token']} exceeds {experts_key} = "
            f"{out['experts']}"
        )
    return out


def read_hf_config(path: Path) -> dict[str, Any]:
    """:func:`spec_fields` of the ``config.json`` at ``path``, the model named after its folder."""
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise ScheduleError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ScheduleError(f"{path} is not a model config (expected a JSON object)")
    return spec_fields(config, where=str(path), name=path.parent.name or path.stem)
