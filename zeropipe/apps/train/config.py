"""What ``zeropipe train`` is asked to do: :class:`TrainConfig`, its flags, and the checks
that refuse, in one line and before any process starts, what could not work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.apps.models.hf_presets import PRESETS
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

__all__ = ["TrainConfig", "add_arguments"]


@dataclass
class TrainConfig:
    """Every knob of ``zeropipe train``; the defaults are the built-in demo."""

    schedule: str = "zbv"
    model: str = "gpt"  # or a Hugging Face preset: llama, qwen3, gpt2
    model_config: str | None = None  # a Hugging Face config.json (with model set from it)
    model_path: str | None = None  # an HF folder (config.json + safetensors): sets the two above
    data: str | None = None  # .txt/.jsonl/.parquet files or folders (comma list); None: generated
    tokenizer: str | None = None  # a tokenizer.json or its folder; default: --model-path's
    text_field: str = "text"  # the field of a .jsonl / .parquet row that holds the text
    data_cache: str | None = None  # where tokenized data is kept; None: ~/.cache/zeropipe/tokens
    ranks: int = 2
    dp: int = 1  # data-parallel replicas of the pipeline
    tp: int = 1  # tensor-parallel processes per pipeline rank: ranks x dp x tp processes
    clip: float | None = None  # clip the gradients' global norm to this
    microbatches: int = 8  # per replica
    batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    warmup: int = 20
    seq: int = 48
    width: int = 96
    blocks: int = 4  # transformer blocks (the GPT's are two layers each: attention, MLP)
    heads: int = 4
    dropout: float = 0.0
    memory_limit: float | None = None
    group_w: int = 1
    recompute: str | None = None
    offload: str | None = None
    device: str = "cpu"
    seed: int = 0
    out: str = "zeropipe-out"
    resume: bool = False
    checkpoint_every: int = 50
    eval_batches: int = 4
    eval_every: int = 0  # steps between eval losses (0: at the start and the end only)
    timeout: float = 120.0
    trace_step: int = 10  # which step's timeline to keep (clamped to the run)
    quiet: bool = False
    profile: bool = False  # rank 0's torch profiler trace of the traced step: torch_trace.json
    overwrite: bool = False  # replace the run in --out (else it is refused without --resume)
    log: str = "jsonl"  # where step metrics go: a comma list of jsonl, tensorboard, wandb
    # The schedule check() built, as text: ranks reuse it instead of rebuilding
    # (with --memory-limit that means re-running fit_memory's search).
    planned: str | None = None

    def check(self) -> None:
        """One-line errors for flags that cannot work, before any process starts."""
        if self.model_path is not None:  # the folder's config.json sets model and model_config
            from zeropipe.apps.hf_folder import resolve_model_path

            resolve_model_path(self)
            folder_tokenizer = Path(self.model_path) / "tokenizer.json"
            if self.tokenizer is None and self.data is not None and folder_tokenizer.is_file():
                self.tokenizer = self.model_path  # the model's own, unless another is named
        if self.tokenizer is not None:  # as the checkpoint records it, for export
            self.tokenizer = str(Path(self.tokenizer).absolute())
        if self.schedule not in GENERATORS:
            raise ZeropipeError(
                f"unknown schedule {self.schedule!r}; choose one of {', '.join(sorted(GENERATORS))}"
            )
        if self.ranks < 1 or self.microbatches < 1 or self.steps < 1 or self.batch_size < 1:
            raise ZeropipeError("--ranks, --microbatches, --steps and --batch-size must be >= 1")
        if self.group_w < 1:
            raise ZeropipeError(
                f"--group-w must be >= 1 (1: the schedule as given), got {self.group_w}"
            )
        if self.dp < 1:
            raise ZeropipeError(f"--dp must be >= 1 (1: one pipeline), got {self.dp}")
        if self.clip is not None and not self.clip > 0:
            raise ZeropipeError(f"--clip must be > 0 (the largest gradient norm), got {self.clip}")
        self._check_numbers()
        if self.batch_size % self.dp:
            raise ZeropipeError(
                f"--batch-size {self.batch_size} cannot be split evenly among --dp {self.dp} "
                f"replicas; use a multiple of {self.dp}"
            )
        if self.batch_size // self.dp < self.microbatches:
            each = " per replica" if self.dp > 1 else ""
            raise ZeropipeError(
                f"--batch-size {self.batch_size} gives {self.batch_size // self.dp} sequences"
                f"{each}, which cannot be cut into --microbatches {self.microbatches}; "
                f"raise the batch size or lower the microbatches"
            )
        _check_device(self.device)
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

    def _check_numbers(self) -> None:
        """The flags that only the ranks would otherwise trip over, each alike."""
        if self.seq < 2:
            raise ZeropipeError(f"--seq must be >= 2 (tokens per sequence), got {self.seq}")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ZeropipeError(
                f"--eval-every must be >= 0 (0: at the start and end only) and --eval-batches "
                f">= 1, got {self.eval_every} and {self.eval_batches}"
            )
        if self.checkpoint_every < 1:
            raise ZeropipeError(
                f"--checkpoint-every must be >= 1 (steps between checkpoints), "
                f"got {self.checkpoint_every}"
            )
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ZeropipeError(
                f"--timeout must be a number of seconds > 0 (how long a rank waits for a "
                f"peer), got {self.timeout:g}"
            )
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ZeropipeError(f"--lr must be a finite number >= 0, got {self.lr:g}")
        if self.memory_limit is not None and not (
            self.memory_limit > 0 and math.isfinite(self.memory_limit)
        ):
            raise ZeropipeError(
                f"--memory-limit must be a number > 0 (microbatches of activations per "
                f"rank), got {self.memory_limit:g}"
            )
        if self.model_config is None:  # a config file's sizes are its own, checked as read
            sizes = (("--width", self.width), ("--blocks", self.blocks), ("heads", self.heads))
            for flag, value in sizes:
                if value < 1:
                    name = flag if flag.startswith("--") else f"TrainConfig.{flag}"
                    raise ZeropipeError(f"{name} must be >= 1, got {value}")
        if self.model == "gpt" and self.width % self.heads:
            fit = self.heads * max(1, round(self.width / self.heads))
            raise ZeropipeError(
                f"--width {self.width} must be a multiple of the {self.heads} heads; "
                f"use e.g. --width {fit}"
            )

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


def _check_device(name: str) -> None:
    """``--device`` must be one torch can parse and this machine has (one-line errors)."""
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


def add_arguments(parser: Any) -> None:
    """The flags of ``zeropipe train`` (defaults: the built-in demo)."""
    d = TrainConfig()
    parser.add_argument(
        "--schedule", default=d.schedule, help=f"schedule generator (default {d.schedule})"
    )
    parser.add_argument(
        "--model",
        default=None,
        help=f"gpt (the reference GPT, default) or a Hugging Face preset: {', '.join(PRESETS)} "
        "(needs transformers: pip install -e '.[hf]')",
    )
    parser.add_argument(
        "--model-config",
        default=None,
        metavar="FILE.json",
        help="a Hugging Face config.json of llama, mistral, qwen2, qwen3 or gpt2 (built from "
        "the config, nothing downloaded); --width/--blocks do not apply",
    )
    parser.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="a Hugging Face folder (config.json + model.safetensors or its sharded index) to "
        "train from: each rank loads only its stages' tensors; not with --model/--model-config",
    )
    parser.add_argument(
        "--data",
        default=None,
        metavar="PATHS",
        help="train on .txt, .jsonl or .parquet files, or folders of them (a comma list): "
        "tokenized once into a memory-mapped cache, packed into --seq tokens with an "
        "end-of-text token between documents, the last tenth of the windows held out for "
        "the eval loss; without a tokenizer a document's UTF-8 bytes are its tokens; "
        "default: a generated corpus",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR|FILE",
        help="a tokenizer.json (or its folder) for --data; default: --model-path's, if it has "
        "one (make one with 'zeropipe tokenizer')",
    )
    parser.add_argument(
        "--text-field",
        default=d.text_field,
        metavar="NAME",
        help=f"the field of a .jsonl / .parquet row that holds its text (default {d.text_field})",
    )
    parser.add_argument(
        "--data-cache",
        default=None,
        metavar="DIR",
        help="where --data's tokens are cached (default $ZEROPIPE_CACHE or "
        "~/.cache/zeropipe/tokens)",
    )
    parser.add_argument(
        "--seq", type=int, default=d.seq, help=f"tokens per sequence (default {d.seq})"
    )
    parser.add_argument(
        "--ranks", type=int, default=d.ranks, help=f"pipeline ranks = processes (default {d.ranks})"
    )
    parser.add_argument(
        "--dp",
        type=int,
        default=d.dp,
        help="data-parallel replicas of the pipeline, each on its slice of every batch: "
        f"--ranks x --dp processes (default {d.dp})",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=d.tp,
        metavar="N",
        help="tensor parallelism: each pipeline rank's layers cut across N processes "
        "(Megatron's layout, whole attention heads each; N must divide the heads): "
        f"--ranks x --dp x --tp processes (default {d.tp})",
    )
    parser.add_argument(
        "--clip",
        type=float,
        default=d.clip,
        metavar="NORM",
        help="clip the gradients' global norm (every stage, rank and replica) to NORM; "
        "metrics.jsonl records the norm before clipping (default: no clipping)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=d.microbatches,
        help=f"per step, per replica (default {d.microbatches})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=d.batch_size,
        help=f"sequences per step (default {d.batch_size})",
    )
    parser.add_argument(
        "--steps", type=int, default=d.steps, help=f"training steps (default {d.steps})"
    )
    parser.add_argument(
        "--lr", type=float, default=d.lr, help=f"AdamW learning rate (default {d.lr})"
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=d.blocks,
        help=f"transformer blocks (default {d.blocks}); the reference GPT's are two layers each "
        "(attention, MLP), between the embedding and the head",
    )
    parser.add_argument(
        "--width", type=int, default=d.width, help=f"model width (default {d.width})"
    )
    parser.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="per-rank activation memory limit in microbatch units; recompute/offload fill the gap",
    )
    parser.add_argument(
        "--group-w",
        type=int,
        default=d.group_w,
        help="split B into I + W and run each stage's W in groups of this many: faster "
        "weight gradients for more activation memory (default 1: the schedule as given)",
    )
    parser.add_argument(
        "--recompute",
        default=None,
        help="checkpoint stages: 'all' or a comma list of stage indices",
    )
    parser.add_argument(
        "--offload", default=None, help="offload activations of stages: 'all' or stage indices"
    )
    parser.add_argument(
        "--device",
        default=d.device,
        help="device of every rank: cpu, or an accelerator this machine has (default cpu)",
    )
    parser.add_argument(
        "--seed", type=int, default=d.seed, help="seed of data, init and dropout (default 0)"
    )
    parser.add_argument("--out", default=d.out, help=f"output folder (default {d.out})")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --out, after checking its files' "
        "sha256; --data, --tokenizer, --seq, --microbatches, --batch-size, --seed, --lr, "
        "--width and --blocks must be those it was saved with (and --data's files unchanged), while --ranks, --dp, --tp and "
        "--schedule (the layout), --steps (above the checkpoint's step, to extend the run), "
        "--checkpoint-every, --eval-every, --timeout, --quiet, --profile, --device and the "
        "memory flags (--group-w, --recompute, --offload, --memory-limit) may change",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints"
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        metavar="STEPS",
        help="steps between eval losses on the held-out data (default 0: at the start and "
        "the end only)",
    )
    parser.add_argument(
        "--eval-batches",
        type=int,
        default=d.eval_batches,
        help=f"held-out batches each eval loss averages (default {d.eval_batches})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=d.timeout,
        help=f"seconds (> 0) a rank waits for a peer; a Ctrl-C or SIGTERM waits up to twice "
        f"this for the ranks to save the step they are in (default {d.timeout:g})",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="write rank 0's torch profiler trace of the step trace.json shows (Chrome trace "
        "JSON, each action named PP:1F3 and so on) to --out's torch_trace.json",
    )
    # Last: it marks the defaults of every flag above, so that --config FILE.toml can tell
    # the flags given from those left out.
    from zeropipe.apps.train.log import add_run_arguments

    add_run_arguments(parser, TrainConfig)
