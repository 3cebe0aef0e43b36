"""What ``zeropipe train`` trains: the model, its cut, its loss and its text.

The training loop of :mod:`zeropipe.apps.train.loop` asks this module for

    check_model(cfg)                    one-line errors for --model / --model-config, and for
                                        a model or rank count this machine cannot hold
    load_corpus(cfg)                    the generated corpus, or --data's documents tokenized
                                        (--tokenizer, or their bytes) and packed into --seq
                                        (zeropipe.apps.data.tokens)
    model_layers(cfg, vocab)            the layers a schedule's stages are cut from
    describe_layers(cfg, vocab)         those layers counted and named, for messages
    more_layers(cfg)                    "use fewer ranks or more --blocks", in the flags given
    model_size(cfg, vocab)              its parameters and their bytes, without building it
    available_memory(), process_limit() what this machine can hold and start (check_model's)
    batch_bytes(cfg, vocab)             a floor under the memory a step's batch takes here
    build_model(cfg, vocab, stages,     the GPT of zeropipe.apps.models.gpt and its cut, or a
                tp_mesh)                Hugging Face model (zeropipe.apps.models.hf_presets) cut
                                        by zeropipe.adapters.split; and the model; tensor-parallel
                                        over tp_mesh (--tp); --model-path: built on meta, each
                                        rank loading its stages (zeropipe.apps.hf_folder)
    loss_fn(cfg)                        the loss that model's outputs are scored with
    batch(corpus, cfg, step)            a step's inputs and targets, on --device

The settings come as any object with the fields of :class:`ModelSettings`
(``zeropipe.apps.train.config.TrainConfig`` is one), so this module need not import the
command that uses it.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from zeropipe.adapters.loss import causal_lm_loss
from zeropipe.adapters.split import split
from zeropipe.adapters.tp import TP_FAMILIES, parallelize
from zeropipe.apps.data.corpus import Corpus
from zeropipe.apps.data.packing import packed_rows
from zeropipe.apps.data.tokens import TokenData, data_paths, data_vocab
from zeropipe.apps.models.gpt import (
    LAYERS,
    GPTConfig,
    gpt,
    gpt_layers,
    lm_loss,
    parallelize_gpt,
)
from zeropipe.apps.models.hf_presets import (
    PRESETS,
    build_hf,
    hf_class_name,
    hf_config,
    with_blocks,
)
from zeropipe.core.errors import ZeropipeError
from zeropipe.planning.balance import even_cut

__all__ = [
    "PROCESS_BYTES",
    "ModelSettings",
    "available_memory",
    "batch",
    "batch_bytes",
    "build_model",
    "check_model",
    "data_cache",
    "describe_layers",
    "load_corpus",
    "loss_fn",
    "model_layers",
    "model_size",
    "more_layers",
    "process_limit",
]

#: Memory a rank's process holds besides the model: the interpreter, torch, the transport.
#: Measured: 230-260 MiB private per rank of the built-in demo (torch 2.13, CPU).
PROCESS_BYTES = 256 * 2**20


class ModelSettings(Protocol):
    """The fields of ``zeropipe.apps.train.config.TrainConfig`` that decide the model and its data."""

    model: str  # gpt, or a Hugging Face preset / a --model-config file's model_type
    model_config: str | None
    model_path: str | None  # a Hugging Face folder: built on meta, each rank its own stages
    data: str | None
    tokenizer: str | None
    text_field: str
    data_cache: str | None
    quiet: bool
    batch_size: int
    seq: int
    width: int
    blocks: int  # transformer blocks (--blocks)
    heads: int
    dropout: float
    device: str
    seed: int
    ranks: int  # pipeline ranks (--ranks)
    microbatches: int  # per replica (--microbatches)
    recompute: str | None  # stages recomputed (--recompute)
    offload: str | None  # stages whose activations are offloaded (--offload)
    checkpoint_blocks: bool  # every block recomputed in its backward (--checkpoint-blocks)
    memory_limit: float | None  # per-rank activation limit (--memory-limit)
    dp: int  # replicas of the pipeline (--dp)
    tp: int  # tensor-parallel processes per pipeline rank (--tp)
    cp: int  # processes sharing each sequence (--cp): ranks x dp x cp x tp processes
    ep: int  # replicas the experts are sharded over (--ep): 1, or dp
    cross_documents: bool  # --data rows: attention crosses documents (--cross-documents)


def check_model(cfg: ModelSettings) -> None:
    """One-line errors for a ``--model`` / ``--model-config`` that names no model we build,
    and for a rank count or a model this machine cannot hold (before any rank starts)."""
    if cfg.model not in ("gpt", *PRESETS) and cfg.model_config is None:
        raise ZeropipeError(
            f"unknown --model {cfg.model!r}; choose gpt, {', '.join(PRESETS)}, or give "
            f"--model-config FILE.json for another config of those architectures"
        )
    if cfg.model_config is not None and cfg.model == "gpt":
        raise ZeropipeError(
            "--model-config describes a Hugging Face model, not --model gpt: leave --model "
            "out (the architecture is the file's model_type)"
        )
    if cfg.model == "gpt" and cfg.width % cfg.heads:
        raise ZeropipeError(f"--width {cfg.width} must be a multiple of the {cfg.heads} heads")
    _check_tp(cfg)
    _check_ep(cfg)
    _check_machine(cfg)


def _divisors(n: int) -> str:
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ", ".join(found[:-1]) + f" or {found[-1]}" if len(found) > 1 else found[0]


def _check_ep(cfg: ModelSettings) -> None:
    """``--ep``: a mixture of experts whose experts the replicas share out evenly."""
    if cfg.ep == 1:
        return
    config = None if cfg.model == "gpt" else hf_model_config(cfg, _vocab(cfg))
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    experts = next((int(getattr(config, k)) for k in keys if getattr(config, k, None)), 0)
    if not experts:
        raise ZeropipeError(
            f"--ep {cfg.ep} with --model {cfg.model}: expert parallelism shards a mixture of "
            f"experts; use --ep 1, or --model qwen3-moe, mixtral or deepseek-v3"
        )
    if experts % cfg.ep:
        raise ZeropipeError(
            f"--ep {cfg.ep} must divide the {cfg.model} model's {experts} experts (each "
            f"replica holds whole experts); use --ep {_divisors(experts)}"
        )


def _check_tp(cfg: ModelSettings) -> None:
    """``--tp``: each tensor-parallel process holds whole attention heads (and, for a Hugging
    Face model, zeropipe has a tensor-parallel plan for it)."""
    if cfg.tp < 1:
        raise ZeropipeError(f"--tp must be >= 1 (1: no tensor parallelism), got {cfg.tp}")
    if cfg.tp == 1:
        return
    if cfg.model == "gpt":
        heads, what = cfg.heads, "the GPT's"
    else:
        config = hf_model_config(cfg, _vocab(cfg))
        kind = hf_class_name(config, cfg.seed)
        if kind not in TP_FAMILIES:
            raise ZeropipeError(
                f"--tp {cfg.tp} with --model {cfg.model}: zeropipe.parallelize has no "
                f"tensor-parallel plan for {kind} (it has one for {', '.join(TP_FAMILIES)}); "
                f"use --tp 1, or a model of those (--model llama, qwen3, qwen3-moe, mixtral or "
                f"deepseek-v3, or --model-config)"
            )
        heads, what = int(config.num_attention_heads), f"the {cfg.model} model's"
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        if kv % cfg.tp:  # grouped-query attention: fewer key/value heads to share out
            raise ZeropipeError(
                f"--tp {cfg.tp} must divide {what} {kv} key/value heads (each process holds "
                f"whole heads); use --tp {_divisors(kv)}"
            )
    if heads % cfg.tp:
        raise ZeropipeError(
            f"--tp {cfg.tp} must divide {what} {heads} attention heads (each process holds "
            f"whole heads); use --tp {_divisors(heads)}"
        )


def available_memory() -> int | None:
    """Bytes of memory this machine can still give, or None where it does not say."""
    try:
        with open("/proc/meminfo") as fh:  # Linux: what can be allocated without swapping
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def process_limit() -> int | None:
    """How many processes one user may run here (``ulimit -u``), or None if unlimited."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    except (AttributeError, ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft <= 0 else int(soft)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _vocab(cfg: ModelSettings) -> int:
    return data_vocab(cfg.data, cfg.tokenizer, cfg.seed)


def model_size(cfg: ModelSettings, vocab: int) -> tuple[int, int]:
    """Parameters and their bytes, without building the model: it is built on the meta
    device (nothing allocated) with one block and with two, and since its blocks are alike
    the rest follows, so a config of billions of parameters or of thousands of blocks is
    sized in about a second."""
    build: Callable[[int], torch.nn.Module]
    if cfg.model == "gpt":
        gpt_cfg = GPTConfig(vocab=vocab, seq=cfg.seq, width=cfg.width, heads=cfg.heads)

        def build(k: int) -> torch.nn.Module:
            return gpt(replace(gpt_cfg, layers=k), seed=cfg.seed)
    else:
        config = hf_model_config(cfg, vocab)

        def build(k: int) -> torch.nn.Module:
            return build_hf(with_blocks(config, k), cfg.seed)

    sizes = []
    for k in (1, 2):
        with torch.device("meta"):
            params = list(build(k).parameters())  # a tied weight once
        sizes.append(
            (sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params))
        )
    (count1, bytes1), (count2, bytes2) = sizes
    more = _blocks(cfg, vocab) - 1
    return count1 + more * (count2 - count1), bytes1 + more * (bytes2 - bytes1)


def _check_machine(cfg: ModelSettings) -> None:
    """Refuse, before anything is launched or built, what would only end when the kernel
    kills a rank: more processes than may run, more ranks than layers, or more memory than
    the machine has."""
    world = cfg.ranks * cfg.dp * cfg.cp * cfg.tp
    layout = (("dp", cfg.dp), ("cp", cfg.cp), ("tp", cfg.tp))
    asked = f"--ranks {cfg.ranks}" + "".join(f" x --{k} {n}" for k, n in layout if n != 1)
    limit = process_limit()
    if limit is not None and world > limit:
        fewer = "--ranks" + (", --dp or --tp" if cfg.dp * cfg.tp > 1 else "")
        raise ZeropipeError(
            f"{asked} would start {world} processes, more than this machine lets one user "
            f"run (ulimit -u: {limit}); use fewer {fewer}"
        )
    vocab = _vocab(cfg)
    layers = model_layers(cfg, vocab)
    if cfg.ranks > layers:  # every schedule has at least one stage per rank
        raise ZeropipeError(
            f"--ranks {cfg.ranks} needs at least {cfg.ranks} stages but the model has "
            f"{describe_layers(cfg, vocab)}, and a stage needs a layer; {more_layers(cfg)} "
            f"(at most {layers} ranks for this model)"
        )
    _check_memory(cfg, vocab, asked, world)


def batch_bytes(cfg: ModelSettings, vocab: int) -> int:
    """A floor under the memory one step's batch takes on this host, summed over every process.

    Each rank process holds the whole batch's token ids (int64 inputs and targets), and
    activations on the CPU: every schedule keeps at least one microbatch's activations at
    every stage at once (the first microbatch's, until its backward reaches the first stage),
    measured at 17 to 42 floats a token per block (the reference GPT and the Hugging Face
    presets, float32) and 1.4 to 8.5 per token per vocabulary entry (the logits and their
    softmax): counted as 16 and 1.  With --recompute, --offload or --memory-limit a stage's
    activations may be recomputed or moved: one block's are counted.
    """
    tokens = cfg.batch_size * cfg.seq
    procs = cfg.ranks * cfg.dp * cfg.cp * cfg.tp
    ids = procs * tokens * (16 if cfg.model == "gpt" else 8)  # an HF model's targets are x
    if torch.device(cfg.device).type != "cpu":  # activations live on the accelerator
        return ids
    if cfg.model == "gpt":
        width, logits = cfg.width, vocab
    else:
        config = hf_model_config(cfg, vocab)
        width, logits = int(config.hidden_size), int(config.vocab_size)
    lean = cfg.recompute is not None or cfg.offload is not None or cfg.memory_limit is not None
    blocks = 1 if lean else _blocks(cfg, vocab)
    microbatch = -(-tokens // cfg.microbatches)  # every replica's microbatch, together
    return ids + microbatch * 4 * (16 * width * blocks + logits)


def _check_memory(cfg: ModelSettings, vocab: int, asked: str, world: int) -> None:
    """Refuse a run whose model, optimizer state and batch cannot fit this machine's memory."""
    free = available_memory()
    if free is None:
        return
    count, model = model_size(cfg, vocab)
    # Every rank builds the whole model (its state_dict names the checkpoint's keys) -- with
    # --model-path on the meta device, materialising only its own stages, about a
    # 1/ranks share; the gradients and AdamW's two moments of one replica's stages add up
    # to the model three times (shared out among a tensor-parallel group, which holds one
    # copy between them, less what stays replicated), on the host unless the stages run
    # on an accelerator.
    state = 3 * model if torch.device(cfg.device).type == "cpu" else 0
    per_batch = batch_bytes(cfg, vocab)

    def need(ranks: int, batch: int = per_batch) -> int:
        procs = ranks * cfg.dp * cfg.tp
        procs += procs > 1  # and the launcher
        # A tenth more for what is not counted: transport buffers, allocator slack.  A
        # 1-rank GPT of 200 blocks peaks at 1.26x the rest, so the estimate stays below
        # what a run takes, and a refusal is never of a run that would have fitted.
        each = model // ranks if cfg.model_path is not None else model
        built = (procs - (procs > 1)) * each
        return int(1.1 * (procs * PROCESS_BYTES + built + cfg.dp * state + batch))

    if need(cfg.ranks) <= free:
        return
    if need(cfg.ranks, 0) <= free:  # the model fits: the batch is what does not
        _refuse_batch(cfg, need(cfg.ranks, 0), per_batch, free)
    fits = max((r for r in range(1, cfg.ranks) if need(r) <= free), default=0)
    if cfg.model_config is not None:
        smaller = (
            f"a smaller --model-config {cfg.model_config} (hidden_size, num_hidden_layers, "
            f"intermediate_size, vocab_size)"
        )
    else:
        smaller = "fewer --blocks or a smaller --width"
    fix = f"use --ranks {fits} or fewer, or {smaller}" if fits else f"use {smaller}"
    each = f"each of {world} processes" if world > 1 else "its one process"
    built = f"built whole in {each}"
    if cfg.model_path is not None:  # the checkpoint's size is what it is
        fix = "train it on an accelerator (--device) or a machine with more memory"
        built = f"its stages shared out among {cfg.ranks} pipeline ranks"
    raise ZeropipeError(
        f"{asked} needs about {_gib(need(cfg.ranks))} of memory (a model of "
        f"{count / 1e6:,.0f}M parameters, {_gib(model)}, {built}, plus its "
        f"gradients, AdamW state, a batch's activations and a tenth more) but this machine "
        f"has {_gib(free)} available; {fix}"
    )


def _refuse_batch(cfg: ModelSettings, rest: int, per_batch: int, free: int) -> None:
    """The one line for a batch too big for the memory the model leaves."""
    room = free / 1.1 - rest / 1.1  # what the batch may take, the tenth's slack kept
    largest = int(cfg.batch_size * room / per_batch) if room > 0 else 0
    fix = (
        f"use --batch-size {largest} or less (or more --microbatches)"
        if largest >= max(cfg.microbatches * cfg.dp, 1)
        else "use a smaller --batch-size or --seq"
    )
    raise ZeropipeError(
        f"--batch-size {cfg.batch_size} of --seq {cfg.seq} tokens needs at least "
        f"{_gib(1.1 * per_batch)} of memory for its token ids and activations, on top of "
        f"the {_gib(rest)} the model and the processes take, but this machine has "
        f"{_gib(free)} available; {fix}"
    )


def load_corpus(cfg: ModelSettings) -> Corpus | TokenData:
    """The training tokens: ``--data`` tokenized (once: later calls read the cache) and
    packed into ``--seq``, or the generated corpus."""
    if cfg.data is None:
        if cfg.tokenizer is not None:
            raise ZeropipeError(
                "--tokenizer tokenizes --data, and no --data is given (the generated corpus "
                "has its own characters as tokens); give --data FILES or leave --tokenizer out"
            )
        return Corpus.generate(seed=cfg.seed)
    from zeropipe.apps.data.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.load(cfg.tokenizer) if cfg.tokenizer is not None else None
    return TokenData.build(
        data_paths(cfg.data),
        tokenizer=tokenizer,
        seq=cfg.seq,
        cache_dir=data_cache(cfg.data_cache),
        text_field=cfg.text_field,
        progress=None if cfg.quiet else print,
    )


def data_cache(given: str | None) -> Path:
    """``--data-cache``, else ``$ZEROPIPE_CACHE``, else ``~/.cache/zeropipe/tokens`` (under
    ``$XDG_CACHE_HOME`` when set)."""
    if given:
        return Path(given)
    if os.environ.get("ZEROPIPE_CACHE"):
        return Path(os.environ["ZEROPIPE_CACHE"])
    home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(home) / "zeropipe" / "tokens"


def hf_model_config(cfg: ModelSettings, vocab: int) -> Any:
    """The transformers config of ``--model`` / ``--model-config`` for ``vocab`` tokens."""
    folder = getattr(cfg, "model_path", None)
    config = hf_config(
        cfg.model,
        vocab=vocab if folder is None else 1,  # a folder's sizes are checked below, in its words
        width=cfg.width,
        blocks=cfg.blocks,
        heads=cfg.heads,
        seq=cfg.seq if folder is None else 1,
        dropout=cfg.dropout,
        config_file=cfg.model_config,
    )
    if folder is not None:
        _check_folder_fits(config, folder, vocab, cfg)
    return config


def _check_folder_fits(config: Any, folder: str, vocab: int, cfg: ModelSettings) -> None:
    """A trained model's vocabulary and position table are fixed: --seq and the tokenizer must
    fit them (told in the flags given: --model-path, --seq, --tokenizer)."""
    key = "n_positions" if getattr(config, "n_positions", None) else "max_position_embeddings"
    positions = getattr(config, key, None)
    if positions is not None and int(positions) < cfg.seq:
        raise ZeropipeError(
            f"--seq {cfg.seq} is beyond the model's position table ({int(positions)}, {key} "
            f"in {Path(folder) / 'config.json'}); give --seq {int(positions)} or less"
        )
    n_vocab = int(config.vocab_size)
    if n_vocab >= vocab:
        return
    if cfg.tokenizer is None:
        raise ZeropipeError(
            f"--data without a tokenizer is read as bytes (256 token ids) but the model at "
            f"{folder} has a vocabulary of {n_vocab}; give --tokenizer, the one the model was "
            f"trained with"
        )
    raise ZeropipeError(
        f"the tokenizer {cfg.tokenizer} has {vocab} tokens but the model at {folder} has a "
        f"vocabulary of {n_vocab}; use the tokenizer the model was trained with"
    )


def _blocks(cfg: ModelSettings, vocab: int) -> int:
    if cfg.model == "gpt":
        return cfg.blocks
    return int(hf_model_config(cfg, vocab).num_hidden_layers)  # --blocks, or the config file's


def model_layers(cfg: ModelSettings, vocab: int) -> int:
    """The model's layers: the most stages it can be cut into.

    The GPT's ``nn.Sequential`` is its embedding, the attention and MLP of each
    block, and its head; a Hugging Face model's stages hold whole decoder layers
    (blocks), with the embedding and the head beside them.
    """
    blocks = _blocks(cfg, vocab)
    return gpt_layers(blocks) if cfg.model == "gpt" else blocks + 2


def more_layers(cfg: ModelSettings) -> str:
    """How a refusal for too few layers ends: fewer ranks, or the setting that adds layers as
    the user gives it (a --model-path model's layers are its own)."""
    if cfg.model_path is not None:
        return f"use fewer ranks (the model at {cfg.model_path} has the layers it was trained with)"
    more = "num_hidden_layers in --model-config" if cfg.model_config else "--blocks"
    return f"use fewer ranks or more {more}"


def describe_layers(cfg: ModelSettings, vocab: int) -> str:
    """:func:`model_layers` counted and named, e.g. '10 layers (4 blocks; embedding, ...)'."""
    blocks = _blocks(cfg, vocab)
    what = LAYERS if cfg.model == "gpt" else "embedding, each block, head"
    return f"{model_layers(cfg, vocab)} layers ({blocks} block{'s' * (blocks != 1)}; {what})"


def _balance(blocks: int, stages: int, per_block: int = 1) -> list[int]:
    """Layers per stage: blocks (of ``per_block`` layers) spread evenly, plus the embedding on
    the first stage and the head on the last (so under zbv, which puts both on rank 0, the
    ranks stay even)."""
    layers = blocks * per_block + 2
    if stages == 1:
        return [layers]
    if blocks < stages:  # too few blocks for one each: spread every layer evenly
        return even_cut(layers, stages)
    counts = [per_block * c for c in even_cut(blocks, stages)]
    counts[0] += 1
    counts[-1] += 1
    return counts


def build_model(
    cfg: ModelSettings, vocab: int, num_stages: int, tp_mesh: Any = None, ep_mesh: Any = None
) -> tuple[torch.nn.Sequential | list[torch.nn.Module], list[int] | None, torch.nn.Module]:
    """What the pipeline runs: the GPT and its cut, or a Hugging Face model's stages; and the
    whole model, whose ``state_dict`` names are the checkpoint's keys whatever the cut.

    ``tp_mesh`` (the 1-D "tp" mesh of ``--tp`` > 1): the whole model is made
    tensor-parallel over it before it is cut -- the GPT by :func:`parallelize_gpt`,
    a Hugging Face model by :func:`zeropipe.adapters.tp.parallelize` (Megatron's layout).
    ``ep_mesh`` (the "dp" mesh of ``--ep`` > 1): a mixture's experts sharded over it.
    """
    if cfg.model == "gpt":
        gpt_cfg = GPTConfig(
            vocab=vocab,
            seq=cfg.seq,
            width=cfg.width,
            heads=cfg.heads,
            layers=cfg.blocks,
            dropout=cfg.dropout,
            checkpoint=cfg.checkpoint_blocks,
        )
        # The GPT's blocks are two layers each (attention, MLP).
        cut = _balance(cfg.blocks, num_stages, per_block=2)
        whole = gpt(gpt_cfg, seed=cfg.seed).to(cfg.device)
        if tp_mesh is not None:
            _parallelize(parallelize_gpt, whole, tp_mesh, cfg)
        return whole, cut, whole
    config = hf_model_config(cfg, vocab)
    blocks = int(config.num_hidden_layers)
    # The GPT's cut with the embedding and head taken off: a fixed cut (not a measured
    # one), so that a checkpoint's stages fit the same run resumed.
    cut = _balance(blocks, num_stages)
    if num_stages > 1:
        cut[0] -= 1
        cut[-1] -= 1
    else:
        cut = [blocks]
    model_path = getattr(cfg, "model_path", None)
    if model_path is not None:
        # Built on meta and cut; this rank reads only its own stages' tensors.
        from zeropipe.apps.hf_folder import build_from_folder

        mine = _my_stages(cfg, num_stages)
        stages, model, _ = build_from_folder(
            model_path, num_stages, cut, mine, cfg.device, cfg.seed, tp_mesh, cfg.checkpoint_blocks
        )
        return stages, None, model
    model = build_hf(config, cfg.seed, checkpoint=cfg.checkpoint_blocks).to(cfg.device)
    if tp_mesh is not None:
        # The whole model, before it is cut: the stages hold its own (now parallel) layers.
        _parallelize(parallelize, model, tp_mesh, cfg)
    if ep_mesh is not None:
        parallelize(model, ep_mesh=ep_mesh)
    return split(model, num_stages, balance=cut), None, model


def _my_stages(cfg: ModelSettings, num_stages: int) -> tuple[int, ...] | range:
    """The stages this process's pipeline rank owns: all of them in one process; else those
    the planned schedule places on rank // (dp x cp x tp) (the mesh's order: "pp" first)."""
    import torch.distributed as dist

    planned = getattr(cfg, "planned", None)
    if not (dist.is_available() and dist.is_initialized()) or cfg.ranks == 1 or not planned:
        return range(num_stages)
    from zeropipe.core.ir import Schedule

    schedule = Schedule.from_text(planned)
    mine = schedule.stages_of(dist.get_rank() // (cfg.dp * cfg.cp * cfg.tp))
    return tuple(sorted({schedule.copy_of(s) for s in mine}))  # a copy runs its original


def _parallelize(
    plan: Callable[[Any, Any], Any], model: torch.nn.Module, tp_mesh: Any, cfg: ModelSettings
) -> None:
    try:
        plan(model, tp_mesh)
    except ValueError as exc:  # a size the plan cannot cut: check_model names the usual ones
        raise ZeropipeError(f"--tp {cfg.tp}: {exc}") from None


def loss_fn(cfg: ModelSettings) -> Callable[..., Any]:
    """The GPT's next-token loss, or HF's shifted causal-LM loss (counted by tokens)."""
    return lm_loss if cfg.model == "gpt" else causal_lm_loss


def batch(
    corpus: Corpus | TokenData, cfg: ModelSettings, step: int, split_name: str = "train"
) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """Inputs and targets: next tokens for the GPT; HF models take labels = inputs and shift,
    their ``--data`` rows with documents masked apart (``apps.data.packing``) unless
    ``--cross-documents`` (or the data has no end-of-text token: bytes)."""
    x, y = corpus.batch(step, cfg.batch_size, cfg.seq, seed=cfg.seed, split=split_name)
    if cfg.model == "gpt":
        return x.to(cfg.device), y.to(cfg.device)
    eos = corpus.eos if isinstance(corpus, TokenData) else None
    if eos is None or cfg.cross_documents:
        return x.to(cfg.device), x.to(cfg.device)
    inputs, labels = packed_rows(x, eos)
    return {k: v.to(cfg.device) for k, v in inputs.items()}, labels.to(cfg.device)
