"""Hugging Face causal LMs for ``zeropipe train``: small presets, or any config file.

    --model llama | qwen3 | gpt2     a preset sized by --width / --blocks (4 heads),
                                     tied embeddings, sized for 2 CPU ranks
    --model qwen3-moe | mixtral      mixtures of experts sized alike: 4 experts, top-2,
      | deepseek-v3                  the router's load-balancing loss on (coefficient
                                     0.01; DeepSeek-V3 has none), DeepSeek-V3 with a
                                     dense first block, a shared expert and MLA
    --model-config FILE.json         any config of a supported architecture
                                     (its "model_type": llama, mistral, qwen2, qwen3, gpt2,
                                     qwen3_moe, mixtral, deepseek_v3)
    --model-path DIR                 a saved HF folder of those: its config.json sets the
                                     model (as --model-config), its safetensors the weights,
                                     each rank reading its stages' (zeropipe.apps.hf_folder)

Models are built from configs with ``AutoModelForCausalLM.from_config``: nothing is
downloaded.  transformers is imported only when one of these is asked for.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropipe.core.errors import ZeropipeError

__all__ = [
    "ARCHITECTURES",
    "PRESETS",
    "build_hf",
    "hf_checkpointing",
    "hf_class_name",
    "hf_config",
    "read_model_config",
    "with_blocks",
]

PRESETS = ("llama", "qwen3", "gpt2", "qwen3-moe", "mixtral", "deepseek-v3")
# model_type in a config file
ARCHITECTURES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gpt2",
    "qwen3_moe",
    "mixtral",
    "deepseek_v3",
)
# The mixtures of experts' presets: 4 experts of which each token takes 2, and the
# router's load-balancing loss at the coefficient their configs default to for training.
_EXPERTS = {"num_experts_per_tok": 2, "output_router_logits": True}
_AUX = 0.01


def read_model_config(path: str) -> dict[str, Any]:
    """The JSON of ``--model-config``, with a ``model_type`` zeropipe.split supports."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ZeropipeError(f"--model-config {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ZeropipeError(f"--model-config {path} is not JSON ({exc})") from None
    kind = data.get("model_type") if isinstance(data, dict) else None
    if kind not in ARCHITECTURES:
        raise ZeropipeError(
            f"--model-config {path}: model_type {kind!r} is not one of "
            f"{', '.join(ARCHITECTURES)}; give a config.json of one of those architectures"
        )
    return dict(data)


def hf_config(
    model: str,
    *,
    vocab: int,
    width: int,
    blocks: int,
    heads: int,
    seq: int,
    dropout: float,
    config_file: str | None = None,
) -> Any:
    """The transformers config of a preset, or of ``config_file`` (checked against the data)."""
    transformers = _transformers(model)
    if config_file is not None:
        data = read_model_config(config_file)
        kind = data.pop("model_type")
        try:
            config = transformers.AutoConfig.for_model(kind, **data)
        except Exception as exc:  # transformers' validators raise several types
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            raise ZeropipeError(
                f"--model-config {config_file}: transformers refuses it "
                f"({lines[-1] if lines else type(exc).__name__}); fix the file"
            ) from None
        n_vocab = int(config.vocab_size)
        positions = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        if n_vocab < vocab:
            raise ZeropipeError(
                f"--model-config {config_file}: vocab_size {n_vocab} is smaller than the data's "
                f"{vocab} tokens; set vocab_size >= {vocab}"
            )
        if positions is not None and int(positions) < seq:
            raise ZeropipeError(
                f"--model-config {config_file}: {int(positions)} positions, fewer than the "
                f"sequence length {seq}; raise max_position_embeddings (n_positions for gpt2)"
            )
        return config
    if width % heads:
        raise ZeropipeError(f"--width {width} must be a multiple of the {heads} heads")
    if model == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=width,
            n_layer=blocks,
            n_head=heads,
            n_positions=max(seq, 128),
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            resid_pdrop=dropout,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        )
    if model in ("qwen3-moe", "mixtral", "deepseek-v3"):
        return _moe_config(transformers, model, vocab, width, blocks, heads, seq, dropout)
    return transformers.AutoConfig.for_model(
        model,
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3 // 8 * 8,
        num_hidden_layers=blocks,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=width // heads,
        max_position_embeddings=max(seq, 128),
        attention_dropout=dropout,
        tie_word_embeddings=True,
    )


def _moe_config(
    transformers: Any,
    model: str,
    vocab: int,
    width: int,
    blocks: int,
    heads: int,
    seq: int,
    dropout: float,
) -> Any:
    """The config of a mixture-of-experts preset (see the module docstring)."""
    common = {
        "vocab_size": vocab,
        "hidden_size": width,
        "intermediate_size": width * 8 // 3 // 8 * 8,
        "num_hidden_layers": blocks,
        "num_attention_heads": heads,
        "max_position_embeddings": max(seq, 128),
        "attention_dropout": dropout,
        "tie_word_embeddings": True,
        **_EXPERTS,
    }
    head_dim = width // heads
    if model == "qwen3-moe":
        return transformers.AutoConfig.for_model(
            "qwen3_moe",
            num_experts=4,
            moe_intermediate_size=width,
            num_key_value_heads=max(1, heads // 2),
            head_dim=head_dim,
            router_aux_loss_coef=_AUX,
            **common,
        )
    if model == "mixtral":
        return transformers.AutoConfig.for_model(
            "mixtral",
            num_local_experts=4,
            num_key_value_heads=max(1, heads // 2),
            head_dim=head_dim,
            router_aux_loss_coef=_AUX,
            **common,
        )
    # DeepSeek-V3: MLA (its keys and values share one low-rank projection, every head its
    # own), experts in two groups of which each token's top group is searched.
    return transformers.AutoConfig.for_model(
        "deepseek_v3",
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        moe_intermediate_size=width,
        num_key_value_heads=heads,
        kv_lora_rank=max(8, width // 2),
        q_lora_rank=max(8, width // 2),
        qk_rope_head_dim=max(2, head_dim // 2 // 2 * 2),
        qk_nope_head_dim=max(2, head_dim // 2),
        v_head_dim=head_dim,
        **common,
    )


def with_blocks(config: Any, blocks: int) -> Any:
    """A copy of ``config`` with ``blocks`` decoder layers (to size the model from a few)."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = blocks  # gpt2's n_layer, through its attribute map
    kinds = getattr(small, "layer_types", None)  # one entry per layer where the config has it
    if isinstance(kinds, list):
        small.layer_types = kinds[:blocks]
    return small


def build_hf(config: Any, seed: int, *, checkpoint: bool = False) -> nn.Module:
    """The model for ``config``, initialised from ``seed`` (the same on every rank), with its
    own gradient checkpointing on if ``checkpoint`` (:func:`hf_checkpointing`)."""
    import transformers

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    finally:
        torch.random.set_rng_state(state)
    if checkpoint:
        hf_checkpointing(model)
    return model


def hf_checkpointing(model: Any) -> None:
    """Turn on ``model``'s own gradient checkpointing, non-reentrant: each decoder layer keeps
    only its input and runs again in its backward (``activation_checkpointing_enable`` where
    transformers has it, else ``gradient_checkpointing_enable``)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ZeropipeError(
            f"{type(model).__name__} does not support gradient checkpointing; leave out "
            f"--checkpoint-blocks (or use --recompute, which recomputes whole stages)"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def hf_class_name(config: Any, seed: int) -> str:
    """The class of the model ``config`` builds, without building it (one block, on meta)."""
    with torch.device("meta"):
        return type(build_hf(with_blocks(config, 1), seed)).__name__


def _transformers(model: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ZeropipeError(
            f"--model {model} needs transformers: pip install -e '.[hf]' (or use --model gpt)"
        ) from None
    return transformers
