"""What ``zeropipe train`` is asked to do: :class:`TrainConfig`, whose fields are its flags
(name, type, default, help and ``--help`` section, see :mod:`zeropipe.apps.cli_args`), and
:meth:`TrainConfig.check`, which refuses in one line and before any process starts what
could not work: :data:`RULES`, the flag rules, each a small function raising one
:class:`ZeropipeError` that names the flag, the value and what would work, applied in
order (the cheap flag checks first, the device last); then the model's size and its
schedule.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zeropipe.apps.cli_args import add_dataclass_arguments, flag
from zeropipe.apps.models.hf_presets import PRESETS
from zeropipe.apps.train.context_parallel import check_context_parallel
from zeropipe.apps.train.workload import (
    check_model,
    describe_layers,
    load_corpus,
    model_layers,
    more_layers,
)
from zeropipe.core.errors import ZeropipeError
from zeropipe.core.ir import Schedule
from zeropipe.core.passes import fit
from zeropipe.core.passes.build import build_schedule
from zeropipe.core.schedules import GENERATORS

__all__ = ["RULES", "Rule", "TrainConfig", "add_arguments"]


# The sections of ``zeropipe train --help``, each a concern.
_MODEL = "model"
_DATA = "data"
_LAYOUT = "schedule and layout"
_OPTIMISATION = "optimisation"
_MEMORY = "activation memory"
_RUN = "the run: its folder, checkpoints, evals and logs"


@dataclass
class TrainConfig:
    """Every knob of ``zeropipe train``; the defaults are the built-in demo.

    A field with :func:`~zeropipe.apps.cli_args.flag` metadata is a flag of the same name
    (:func:`add_arguments`) and a key of ``--config``'s file; the rest only the Python API sets.
    """

    model: str = field(
        default="gpt",
        metadata=flag(
            "{default} (the reference GPT, default) or a Hugging Face preset: "
            f"{', '.join(PRESETS)} "
            "(needs transformers: pip install -e '.[hf]')",
            group=_MODEL,
        ),
    )
    model_config: str | None = field(
        default=None,
        metadata=flag(
            "a Hugging Face config.json of llama, mistral, qwen2, qwen3, gpt2, qwen3_moe, "
            "mixtral or deepseek_v3 (built from "
            "the config, nothing downloaded); --width/--blocks do not apply",
            group=_MODEL,
            metavar="FILE.json",
        ),
    )
    model_path: str | None = field(  # sets model and model_config from the folder's config
        default=None,
        metadata=flag(
            "a Hugging Face folder (config.json + model.safetensors or its sharded index) to "
            "train from: each rank loads only its stages' tensors; not with --model/--model-config",
            group=_MODEL,
            metavar="DIR",
        ),
    )
    blocks: int = field(
        default=4,
        metadata=flag(
            "transformer blocks (default {default}); the reference GPT's are two layers each "
            "(attention, MLP), between the embedding and the head",
            group=_MODEL,
        ),
    )
    width: int = field(default=96, metadata=flag("model width (default {default})", group=_MODEL))
    heads: int = 4  # no flag: the reference GPT's attention heads
    dropout: float = 0.0  # no flag
    data: str | None = field(  # None: the generated corpus
        default=None,
        metadata=flag(
            "train on .txt, .jsonl or .parquet files, or folders of them (a comma list): "
            "tokenized once into a memory-mapped cache, packed into --seq tokens with an "
            "end-of-text token between documents, the last tenth of the windows held out for "
            "the eval loss; without a tokenizer a document's UTF-8 bytes are its tokens; "
            "default: a generated corpus",
            group=_DATA,
            metavar="PATHS",
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=flag(
            "a tokenizer.json (or its folder) for --data; default: --model-path's, if it has "
            "one (make one with 'zeropipe tokenizer')",
            group=_DATA,
            metavar="DIR|FILE",
        ),
    )
    text_field: str = field(
        default="text",
        metadata=flag(
            "the field of a .jsonl / .parquet row that holds its text (default {default})",
            group=_DATA,
            metavar="NAME",
        ),
    )
    data_cache: str | None = field(
        default=None,
        metadata=flag(
            "where --data's tokens are cached (default $ZEROPIPE_CACHE or "
            "~/.cache/zeropipe/tokens)",
            group=_DATA,
            metavar="DIR",
        ),
    )
    seq: int = field(
        default=48, metadata=flag("tokens per sequence (default {default})", group=_DATA)
    )
    cross_documents: bool = field(
        default=False,
        metadata=flag(
            "let attention cross the end-of-text token between packed documents, as GPT-2's "
            "pretraining did; by default a Hugging Face model's --data rows restart their "
            "position ids at each document, attention never crosses one and no document's "
            "first token is predicted from the one before (the reference GPT always crosses)",
            group=_DATA,
        ),
    )
    schedule: str = field(
        default="zbv", metadata=flag("schedule generator (default {default})", group=_LAYOUT)
    )
    ranks: int = field(
        default=2, metadata=flag("pipeline ranks = processes (default {default})", group=_LAYOUT)
    )
    dp: int = field(
        default=1,
        metadata=flag(
            "data-parallel replicas of the pipeline, each on its slice of every batch: "
            "--ranks x --dp processes (default {default})",
            group=_LAYOUT,
        ),
    )
    tp: int = field(
        default=1,
        metadata=flag(
            "tensor parallelism: each pipeline rank's layers cut across N processes "
            "(Megatron's layout, whole attention heads each; N must divide the heads): "
            "--ranks x --dp x --cp x --tp processes (default {default})",
            group=_LAYOUT,
            metavar="N",
        ),
    )
    cp: int = field(
        default=1,
        metadata=flag(
            "context parallelism: every sequence sharded over N processes per pipeline rank, "
            "each an early and a late chunk, attention over all of it (Llama, Mistral, Qwen2, "
            "Qwen3; --seq divisible by 2 x N): --ranks x --dp x --cp x --tp processes "
            "(default {default})",
            group=_LAYOUT,
            metavar="N",
        ),
    )
    ep: int = field(
        default=1,
        metadata=flag(
            "expert parallelism: a mixture of experts' experts sharded over N data-parallel "
            "replicas, each holding experts / N of them (ep inside dp: N divides --dp, and "
            "with --dp 1 the replicas become N): --ranks x --dp processes (default {default})",
            group=_LAYOUT,
            metavar="N",
        ),
    )
    microbatches: int = field(
        default=8, metadata=flag("per step, per replica (default {default})", group=_LAYOUT)
    )
    device: str = field(
        default="cpu",
        metadata=flag(
            "device of every rank: cpu, or an accelerator this machine has (default {default})",
            group=_LAYOUT,
        ),
    )
    batch_size: int = field(
        default=16, metadata=flag("sequences per step (default {default})", group=_OPTIMISATION)
    )
    steps: int = field(
        default=300, metadata=flag("training steps (default {default})", group=_OPTIMISATION)
    )
    lr: float = field(
        default=3e-3,
        metadata=flag("AdamW learning rate (default {default})", group=_OPTIMISATION),
    )
    warmup: int = 20  # no flag: steps of linear learning-rate warm-up
    clip: float | None = field(
        default=None,
        metadata=flag(
            "clip the gradients' global norm (every stage, rank and replica) to NORM; "
            "metrics.jsonl records the norm before clipping (default: no clipping)",
            group=_OPTIMISATION,
            metavar="NORM",
        ),
    )
    seed: int = field(
        default=0,
        metadata=flag("seed of data, init and dropout (default {default})", group=_OPTIMISATION),
    )
    memory_limit: float | None = field(
        default=None,
        metadata=flag(
            "per-rank activation memory limit in microbatch units; recompute/offload fill the "
            "gap (default: no limit)",
            group=_MEMORY,
        ),
    )
    group_w: int = field(
        default=1,
        metadata=flag(
            "split B into I + W and run each stage's W in groups of this many: faster "
            "weight gradients for more activation memory (default {default}: the schedule as "
            "given)",
            group=_MEMORY,
        ),
    )
    recompute: str | None = field(
        default=None,
        metadata=flag(
            "checkpoint stages: 'all' or a comma list of stage indices (default: none)",
            group=_MEMORY,
        ),
    )
    offload: str | None = field(
        default=None,
        metadata=flag(
            "offload activations of stages: 'all' or stage indices (default: none)",
            group=_MEMORY,
        ),
    )
    checkpoint_blocks: bool = field(
        default=False,
        metadata=flag(
            "checkpoint every block on its own: it keeps only its input and runs its forward "
            "again in its backward (torch.utils.checkpoint; a Hugging Face model's own "
            "gradient checkpointing)",
            group=_MEMORY,
        ),
    )
    out: str = field(
        default="zeropipe-out", metadata=flag("output folder (default {default})", group=_RUN)
    )
    resume: bool = field(
        default=False,
        metadata=flag(
            "continue from the newest complete checkpoint in --out, after checking its files' "
            "sha256; --data, --tokenizer, --seq, --microbatches, --batch-size, --seed, --lr, "
            "--width and --blocks must be those it was saved with (and --data's files "
            "unchanged), while --ranks, --dp, --tp and --schedule (the layout), --steps "
            "(above the checkpoint's step, to extend the run), --checkpoint-every, "
            "--eval-every, --timeout, --quiet, --profile, --device and the memory flags "
            "(--group-w, --recompute, --offload, --memory-limit, --checkpoint-blocks) may change",
            group=_RUN,
        ),
    )
    overwrite: bool = field(
        default=False,
        metadata=flag(
            "replace the run in --out (its metrics.jsonl, pictures, trace, and what it wrote "
            "in checkpoints/, tensorboard/ and wandb/; nothing else) instead of refusing it",
            group=_RUN,
        ),
    )
    checkpoint_every: int = field(
        default=50,
        metadata=flag("steps between checkpoints (default {default})", group=_RUN),
    )
    eval_every: int = field(
        default=0,
        metadata=flag(
            "steps between eval losses on the held-out data (default {default}: at the start "
            "and the end only)",
            group=_RUN,
            metavar="STEPS",
        ),
    )
    eval_batches: int = field(
        default=4,
        metadata=flag("held-out batches each eval loss averages (default {default})", group=_RUN),
    )
    trace_step: int = 10  # no flag: which step's timeline to keep (clamped to the run)
    timeout: float = field(
        default=120.0,
        metadata=flag(
            "seconds (> 0) a rank waits for a peer; a Ctrl-C or SIGTERM waits up to twice "
            "this for the ranks to save the step they are in (default {default:g})",
            group=_RUN,
        ),
    )
    quiet: bool = field(default=False, metadata=flag("no progress bar or summary", group=_RUN))
    profile: bool = field(
        default=False,
        metadata=flag(
            "write rank 0's torch profiler trace of the step trace.json shows (Chrome trace "
            "JSON, each action named PP:1F3 and so on) to --out's torch_trace.json",
            group=_RUN,
        ),
    )
    log: str = field(
        default="jsonl",
        metadata=flag(
            "where step metrics go, a comma list of jsonl (metrics.jsonl), tensorboard "
            "(<out>/tensorboard; pip install 'zeropipe[tensorboard]') and wandb (offline, "
            "<out>/wandb; pip install 'zeropipe[wandb]') (default {default})",
            group=_RUN,
            metavar="SINKS",
        ),
    )
    # No flag: the schedule check() built, as text: ranks reuse it instead of rebuilding
    # (with --memory-limit that means re-running fit_memory's search).
    planned: str | None = None

    def check(self) -> None:
        """One-line errors for flags that cannot work, before any process starts: the paths
        resolved, each of :data:`RULES` in turn, then the model's size and the schedule it
        trains with (kept as :attr:`planned`)."""
        self._resolve_paths()
        for rule in RULES:
            rule(self)
        # The model's size first: it refuses absurd rank counts before a schedule is built.
        check_model(self)
        schedule = self.build_schedule()
        vocab = load_corpus(self).vocab
        if schedule.num_stages > model_layers(self, vocab):
            raise ZeropipeError(
                f"--ranks {self.ranks} with {self.schedule} needs {schedule.num_stages} stages "
                f"but the model has {describe_layers(self, vocab)}, and a stage needs a layer; "
                f"{more_layers(self)}"
            )
        self.planned = schedule.to_text()

    def _resolve_paths(self) -> None:
        """``--model-path``'s folder read into the model fields (and its tokenizer taken for
        ``--data``, unless another is named); ``--tokenizer`` made absolute, as the
        checkpoint records it for export."""
        if self.model_path is not None:
            from zeropipe.apps.hf_folder import resolve_model_path

            resolve_model_path(self)
            folder_tokenizer = Path(self.model_path) / "tokenizer.json"
            if self.tokenizer is None and self.data is not None and folder_tokenizer.is_file():
                self.tokenizer = self.model_path
        if self.tokenizer is not None:
            self.tokenizer = str(Path(self.tokenizer).absolute())

    def build_schedule(self) -> Schedule:
        """The schedule to train with: built as any pipeline's, plus the memory actions asked for.

        :func:`zeropipe.core.passes.build.build_schedule` generates it and gathers W
        (``--group-w``) first, so the memory actions see the W-parts it keeps
        alive.  ``--recompute`` / ``--offload`` checkpoint / offload the named
        stages ('all' or indices); ``--memory-limit`` (microbatch units per
        rank) lets :func:`zeropipe.core.passes.fit.fit_memory` choose, and fails in one line
        naming the smallest limit that would fit.
        """
        try:
            schedule = build_schedule(
                self.schedule,
                ranks=self.ranks,
                microbatches=self.microbatches,
                group_w=self.group_w,
            )
        except ZeropipeError as exc:
            raise ZeropipeError(
                f"--schedule {self.schedule} with --ranks {self.ranks}: {str(exc).splitlines()[0]}"
            ) from None
        if self.recompute is not None:
            schedule = fit.checkpoint(
                schedule, _stage_choice(self.recompute, schedule, "--recompute")
            )
        if self.offload is not None:
            schedule = fit.offload(schedule, _stage_choice(self.offload, schedule, "--offload"))
        if self.memory_limit is not None:
            try:
                schedule = fit.fit_memory(schedule, self.memory_limit).schedule
            except fit.LimitTooLow as exc:
                raise ZeropipeError(
                    f"--memory-limit {self.memory_limit:g} is too small for {self.schedule} on "
                    f"{self.ranks} ranks: raise it to at least {max(exc.smallest):g} "
                    f"(microbatches of activations per rank)"
                ) from None
        return schedule


# -- the flag rules: each refuses, in one line, a flag that cannot work ------------------

#: A flag rule: returns, or raises a one-line ZeropipeError naming the flag and the value.
Rule = Callable[[TrainConfig], None]


def _known_schedule(cfg: TrainConfig) -> None:
    """``--schedule`` names a registered generator."""
    if cfg.schedule not in GENERATORS:
        raise ZeropipeError(
            f"unknown schedule {cfg.schedule!r}; choose one of {', '.join(sorted(GENERATORS))}"
        )


def _counts_at_least_one(cfg: TrainConfig) -> None:
    """The counts that have no zero: ranks, microbatches, steps, batch, W groups, replicas."""
    if cfg.ranks < 1 or cfg.microbatches < 1 or cfg.steps < 1 or cfg.batch_size < 1:
        raise ZeropipeError("--ranks, --microbatches, --steps and --batch-size must be >= 1")
    if cfg.group_w < 1:
        raise ZeropipeError(f"--group-w must be >= 1 (1: the schedule as given), got {cfg.group_w}")
    if cfg.dp < 1:
        raise ZeropipeError(f"--dp must be >= 1 (1: one pipeline), got {cfg.dp}")


def _experts_inside_replicas(cfg: TrainConfig) -> None:
    """``--ep N`` shards the experts over blocks of N data-parallel replicas: N replicas
    when ``--dp`` is left at 1, else N must divide ``--dp``."""
    if cfg.ep < 1:
        raise ZeropipeError(f"--ep must be >= 1 (1: no expert parallelism), got {cfg.ep}")
    if cfg.ep > 1 and cfg.dp == 1:
        cfg.dp = cfg.ep
    if cfg.dp % cfg.ep:
        raise ZeropipeError(
            f"--ep {cfg.ep} with --dp {cfg.dp}: the experts are sharded over blocks of "
            f"--ep replicas (ep inside dp), so --ep must divide --dp; use --dp a multiple of "
            f"{cfg.ep}, or leave --dp out (--ep {cfg.ep} then makes {cfg.ep} replicas)"
        )
    if cfg.ep > 1 and cfg.model_path is not None:
        raise ZeropipeError(
            f"--ep {cfg.ep} with --model-path: expert parallelism of a model read from a "
            f"folder is not supported yet; use --ep 1, or a built-in --model"
        )


def _clip_positive(cfg: TrainConfig) -> None:
    """A ``--clip`` norm, if given, is positive."""
    if cfg.clip is not None and not cfg.clip > 0:
        raise ZeropipeError(f"--clip must be > 0 (the largest gradient norm), got {cfg.clip}")


def _sequence_of_two(cfg: TrainConfig) -> None:
    """A sequence holds an input and the next token to predict, at least."""
    if cfg.seq < 2:
        raise ZeropipeError(f"--seq must be >= 2 (tokens per sequence), got {cfg.seq}")


def _eval_and_checkpoint_steps(cfg: TrainConfig) -> None:
    """How often to evaluate and checkpoint, and how many batches an eval averages."""
    if cfg.eval_every < 0 or cfg.eval_batches < 1:
        raise ZeropipeError(
            f"--eval-every must be >= 0 (0: at the start and end only) and --eval-batches "
            f">= 1, got {cfg.eval_every} and {cfg.eval_batches}"
        )
    if cfg.checkpoint_every < 1:
        raise ZeropipeError(
            f"--checkpoint-every must be >= 1 (steps between checkpoints), "
            f"got {cfg.checkpoint_every}"
        )


def _finite_numbers(cfg: TrainConfig) -> None:
    """The float flags: NaN and infinity are refused with the rest of what is out of range."""
    if not (cfg.timeout > 0 and math.isfinite(cfg.timeout)):
        raise ZeropipeError(
            f"--timeout must be a number of seconds > 0 (how long a rank waits for a "
            f"peer), got {cfg.timeout:g}"
        )
    if not (cfg.lr >= 0 and math.isfinite(cfg.lr)):
        raise ZeropipeError(f"--lr must be a finite number >= 0, got {cfg.lr:g}")
    if cfg.memory_limit is not None and not (
        cfg.memory_limit > 0 and math.isfinite(cfg.memory_limit)
    ):
        raise ZeropipeError(
            f"--memory-limit must be a number > 0 (microbatches of activations per "
            f"rank), got {cfg.memory_limit:g}"
        )


def _model_sizes(cfg: TrainConfig) -> None:
    """The reference model's sizes; a config file's sizes are its own, checked as read."""
    if cfg.model_config is None:
        sizes = (("--width", cfg.width), ("--blocks", cfg.blocks), ("heads", cfg.heads))
        for name, value in sizes:
            if value < 1:
                shown = name if name.startswith("--") else f"TrainConfig.{name}"
                raise ZeropipeError(f"{shown} must be >= 1, got {value}")
    if cfg.model == "gpt" and cfg.width % cfg.heads:
        fit = cfg.heads * max(1, round(cfg.width / cfg.heads))
        raise ZeropipeError(
            f"--width {cfg.width} must be a multiple of the {cfg.heads} heads; "
            f"use e.g. --width {fit}"
        )


def _batch_splits(cfg: TrainConfig) -> None:
    """A batch splits evenly among the replicas, and each share into the microbatches."""
    if cfg.batch_size % cfg.dp:
        raise ZeropipeError(
            f"--batch-size {cfg.batch_size} cannot be split evenly among --dp {cfg.dp} "
            f"replicas; use a multiple of {cfg.dp}"
        )
    if cfg.batch_size // cfg.dp < cfg.microbatches:
        each = " per replica" if cfg.dp > 1 else ""
        raise ZeropipeError(
            f"--batch-size {cfg.batch_size} gives {cfg.batch_size // cfg.dp} sequences"
            f"{each}, which cannot be cut into --microbatches {cfg.microbatches}; "
            f"raise the batch size or lower the microbatches"
        )


def _device_here(cfg: TrainConfig) -> None:
    """``--device`` must be one torch can parse and this machine has."""
    name = cfg.device
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    here = accel.current_accelerator() if accel is not None and accel.is_available() else None
    # Examples from what this machine has: the device module is the one place naming a type.
    valid = "cpu" if here is None else f"cpu, {here.type} or {here.type}:0"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else "not a device"
        raise ZeropipeError(
            f"--device {name!r} is not a device torch knows ({why}); use e.g. {valid}"
        ) from None
    if device.type == "cpu":
        return
    if device.type == "meta":
        raise ZeropipeError(f"--device {name!r} holds no data, so nothing trains; use e.g. {valid}")
    if here is None or here.type != device.type:
        raise ZeropipeError(f"--device {name!r} is not available on this machine; use e.g. {valid}")
    count = accel.device_count() if accel is not None else 0
    if device.index is not None and device.index >= count:
        raise ZeropipeError(
            f"--device {name!r}: this machine has {count} {device.type} device(s), numbered from 0; "
            f"use e.g. {valid}"
        )


#: The flag rules, in the order they are applied: the first that fails is the one reported.
RULES: tuple[Rule, ...] = (
    _known_schedule,
    _counts_at_least_one,
    _experts_inside_replicas,
    check_context_parallel,
    _clip_positive,
    _sequence_of_two,
    _eval_and_checkpoint_steps,
    _finite_numbers,
    _model_sizes,
    _batch_splits,
    _device_here,
)


def _stage_choice(spec: str, schedule: Schedule, flag: str) -> Callable[[int, int], bool] | None:
    """'all' or '0,2': which stages a memory flag applies to."""
    if spec.strip() == "all":
        return None
    try:
        chosen = {int(t) for t in spec.split(",") if t.strip()}
    except ValueError:
        raise ZeropipeError(
            f"{flag} takes 'all' or stage indices like '0,1', got {spec!r}"
        ) from None
    bad = sorted(s for s in chosen if not 0 <= s < schedule.num_stages)
    if bad:
        raise ZeropipeError(
            f"{flag}: stage(s) {bad} do not exist; this schedule has stages 0..{schedule.num_stages - 1}"
        )
    return lambda stage, mb: stage in chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``zeropipe train``: one per flag field of :class:`TrainConfig`, then
    ``--config FILE.toml``."""
    add_dataclass_arguments(parser, TrainConfig)
    # Last: it marks the defaults of every flag above, so that --config FILE.toml can tell
    # the flags given from those left out.
    from zeropipe.apps.train.log import add_config_argument

    add_config_argument(parser, TrainConfig)
