"""``zeropipe train``: a small GPT (or a Hugging Face causal LM) trained across pipeline ranks.

One call of :func:`train` spawns ``ranks`` processes over gloo (or, under
torchrun, runs as the rank it was started as), trains the GPT of
:mod:`zeropipe.apps.models.gpt` (``--model gpt``, the default) or a Hugging Face
model of :mod:`zeropipe.apps.models.hf` cut by :func:`zeropipe.adapters.split.split`
(``--model llama|qwen3|gpt2``, ``--model-config FILE.json``) on the generated
corpus of :mod:`zeropipe.apps.data` (or the bytes of ``--data FILE``) under the
chosen schedule -- :mod:`zeropipe.apps.train_setup` builds the model, its cut, its
loss and its batches -- and leaves in ``--out``::

    metrics.jsonl      one JSON object per step: step, loss, tokens_per_s, ...
    checkpoints/       the last complete checkpoints, in torch's distributed checkpoint
                       format (see zeropipe.apps.train_state and zeropipe.apps.train_resume)
    timeline.png       the planned (simulated) and measured timelines of one step
    trace.json         Chrome trace of that measured step (opens in Perfetto)
    loss.png           the loss curve

(:mod:`zeropipe.apps.train_report` measures, prints and draws what a run reports.)

Stopping: Ctrl-C (SIGINT) is turned into a request that all ranks agree on at
the next step boundary; they save a checkpoint and exit.  ``--resume``
continues from the newest complete checkpoint, reading exactly the batches
an uninterrupted run would have read, so its losses are the same -- also on
another ``--ranks`` or ``--schedule`` (the checkpoint is keyed by the model's
parameter names).  Before any rank starts, it checks the checkpoint's files
against their sha256 and the settings it was saved with against the flags
(:func:`check_resume`).  ``zeropipe export`` writes a checkpoint's model as
one safetensors file.

A non-finite loss, or non-finite weights about to be saved, stop every rank
at once without saving: ``latest`` keeps naming the last finite checkpoint,
and :func:`train` raises one line naming the step.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeropipe.apps import train_report, train_resume
from zeropipe.apps.cli_args import refuse_renamed
from zeropipe.apps.data import Corpus
from zeropipe.apps.models.hf import PRESETS
from zeropipe.apps.train_resume import check_resume, run_settings
from zeropipe.apps.train_setup import (
    batch,
    build_model,
    check_model,
    describe_layers,
    load_corpus,
    loss_fn,
    model_layers,
)
from zeropipe.core import fit
from zeropipe.core.build import build_schedule
from zeropipe.core.errors import PipelineError, ZeropipeError
from zeropipe.core.ir import Schedule
from zeropipe.core.schedules import GENERATORS
from zeropipe.core.simulate import Timeline
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

__all__ = ["TrainConfig", "check_resume", "run_settings", "train", "train_rank"]


@dataclass
class TrainConfig:
    """Every knob of ``zeropipe train``; the defaults are the built-in demo."""

    schedule: str = "zbv"
    model: str = "gpt"  # or a Hugging Face preset: llama, qwen3, gpt2
    model_config: str | None = None  # a Hugging Face config.json (with model set from it)
    data: str | None = None  # a UTF-8 text file (bytes as tokens); None: the generated corpus
    ranks: int = 2
    dp: int = 1  # data-parallel replicas of the pipeline: ranks x dp processes
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
    timeout: float = 120.0
    trace_step: int = 10  # which step's timeline to keep (clamped to the run)
    quiet: bool = False
    # The schedule check() built, as text: ranks reuse it instead of rebuilding
    # (with --memory-limit that means re-running fit_memory's search).
    planned: str | None = None

    def check(self) -> None:
        """One-line errors for flags that cannot work, before any process starts."""
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
        schedule = self.build_schedule()
        check_model(self)
        vocab = load_corpus(self).vocab
        if schedule.num_stages > model_layers(self, vocab):
            more = "num_hidden_layers in --model-config" if self.model_config else "--blocks"
            raise ZeropipeError(
                f"--ranks {self.ranks} with {self.schedule} needs {schedule.num_stages} stages "
                f"but the model has {describe_layers(self, vocab)}, and a stage needs a layer; "
                f"use fewer ranks or more {more}"
            )
        self.planned = schedule.to_text()

    def build_schedule(self) -> Schedule:
        """The schedule to train with: built as any pipeline's, plus the memory actions asked for.

        :func:`zeropipe.core.build.build_schedule` generates it and gathers W
        (``--group-w``) first, so the memory actions see the W-parts it keeps
        alive.  ``--recompute`` / ``--offload`` checkpoint / offload the named
        stages ('all' or indices); ``--memory-limit`` (microbatch units per
        rank) lets :func:`zeropipe.core.fit.fit_memory` choose, and fails in one line
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


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the training job; returns rank 0's summary.

    With ``resume``, the checkpoint is verified and the settings it was saved
    with compared with ``cfg`` before any rank starts (one-line errors).  A
    loss or weights that turn non-finite end the run, unsaved, with a
    :class:`ZeropipeError` naming the step.
    """
    cfg.check()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        from zeropipe.runtime.launch import init_from_env

        rank, world = init_from_env(timeout=cfg.timeout)
        if world % cfg.dp:
            raise ZeropipeError(
                f"torchrun started {world} processes, which --dp {cfg.dp} replicas cannot share"
            )
        if world != cfg.ranks * cfg.dp:
            cfg.ranks = world // cfg.dp
        if cfg.resume:
            check_resume(cfg, warn=rank == 0)
        summary = train_rank(rank, world, cfg)
    elif cfg.ranks * cfg.dp == 1:
        if cfg.resume:
            check_resume(cfg)
        summary = train_rank(0, 1, cfg)
    else:
        from zeropipe.runtime.launch import launch

        if cfg.resume:
            check_resume(cfg)
        results = launch(
            train_rank,
            cfg.ranks * cfg.dp,
            cfg,
            timeout=cfg.timeout * 4 + cfg.steps * 5.0,
            threads=1,
        )
        summary = results[0]
    if summary.get("non_finite") is not None:
        raise ZeropipeError(train_resume.non_finite_message(summary["non_finite"], cfg))
    return summary


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    """The training loop as one rank runs it (also the whole job when ranks == 1)."""
    torch.set_num_threads(1)
    out = Path(cfg.out)
    ckpt_root = out / "checkpoints"
    lead = rank == 0
    corpus = load_corpus(cfg)
    schedule = Schedule.from_text(cfg.planned) if cfg.planned else cfg.build_schedule()
    stages, cut, model = build_model(cfg, corpus.vocab, schedule.num_stages)
    pipe = Pipeline(
        stages,
        schedule,
        loss_fn=loss_fn(cfg),
        balance=cut,
        mesh=_mesh(cfg) if cfg.dp > 1 else (None if cfg.ranks > 1 else "local"),
        options=RuntimeOptions(seed=cfg.seed, timeout=cfg.timeout),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr, weight_decay=0.0)
    start = train_resume.resume(ckpt_root, rank, pipe, optimizer, cfg, model) if cfg.resume else 0
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        train_resume.trim_metrics(out / "metrics.jsonl", start)
    stop = _StopRequest()
    tokens = cfg.batch_size * cfg.seq
    initial_eval = _evaluate(pipe, corpus, cfg)
    losses: list[float] = []
    trace_step = min(max(start, cfg.trace_step), cfg.steps - 1)
    measured: Timeline | None = None
    wall0 = time.perf_counter()
    step = start
    non_finite: dict[str, Any] | None = None  # why and where training stopped short
    while step < cfg.steps:
        for group in optimizer.param_groups:  # linear warm-up: no early loss spikes
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        x, y = _mine(pipe, *batch(corpus, cfg, step))
        t0 = time.perf_counter()
        loss = pipe.step(x, y)
        norm = None if cfg.clip is None else pipe.clip_grad_norm_(cfg.clip).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        bubble = train_report.bubble_rate(pipe, elapsed, world)
        if step == trace_step:
            measured = train_report.gather_timeline(pipe, world)
        step += 1
        value = loss.item()
        # The loss is the same on every rank; agreeing on it anyway keeps every rank on
        # the same path even if one saw it differently.  One all-reduce for both flags.
        stopping, diverged = _agree([stop.requested, not math.isfinite(value)], world)
        if diverged:  # saving now would make a checkpoint no run should resume from
            non_finite = {"what": "loss", "step": step, "loss": value}
            break
        losses.append(value)
        peak = train_report.peak_bytes(pipe)
        record = {
            "step": step,
            "loss": value,
            "tokens_per_s": tokens / elapsed,
            "step_s": elapsed,
            "bubble_rate": bubble,
            "peak_saved_bytes": peak,
        }
        if norm is not None:
            record["grad_norm"] = norm  # before clipping
        if lead:
            with open(out / "metrics.jsonl", "a") as fh:
                fh.write(json.dumps(record) + "\n")
            if not cfg.quiet:
                train_report.progress(record, cfg.steps)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
            # A finite loss can still be followed by an update that overflowed.
            if _agree([not _weights_finite(pipe)], world)[0]:
                non_finite = {"what": "weights", "step": step, "loss": value}
                break
            train_resume.save(ckpt_root, step, pipe, optimizer, cfg, model)
        if stopping:
            if lead:
                print(f"\nstopped at step {step}; resume with --resume", flush=True)
            break
    final_eval = _evaluate(pipe, corpus, cfg) if non_finite is None else math.nan
    summary = {
        "model": cfg.model,
        "schedule": cfg.schedule,
        "group_w": cfg.group_w,
        "ranks": cfg.ranks,
        "dp": cfg.dp,
        "steps_run": step - start,
        "last_step": step,
        "initial_eval_loss": initial_eval,
        "final_eval_loss": final_eval,
        "final_train_loss": losses[-1] if losses else math.nan,
        "wall_s": time.perf_counter() - wall0,
        "interrupted": stop.requested,
        "non_finite": non_finite,
    }
    if lead:
        if not cfg.quiet:
            print()
        train_report.write_pictures(out, pipe, measured)
        if not cfg.quiet and non_finite is None:  # train() reports a non-finite stop
            train_report.print_summary(summary, out)
    return summary


class _StopRequest:
    """Ctrl-C sets a flag; the ranks agree on it at the next step boundary."""

    def __init__(self) -> None:
        self.requested = False
        if hasattr(signal, "SIGINT"):
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = True


def _agree(flags: list[bool], world: int) -> list[bool]:
    """Each flag, true on every rank if it is true on any."""
    if world == 1:
        return flags
    t = torch.tensor([1 if f else 0 for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def _weights_finite(pipe: Pipeline) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in pipe.parameters())


def _evaluate(pipe: Pipeline, corpus: Corpus, cfg: TrainConfig) -> float:
    total = 0.0
    for k in range(cfg.eval_batches):
        x, y = _mine(pipe, *batch(corpus, cfg, k, "val"))
        loss = pipe.eval_step(x, y)
        if not isinstance(loss, torch.Tensor):
            raise PipelineError("evaluation produced no loss")
        total += loss.item()
    return total / cfg.eval_batches


def _mesh(cfg: TrainConfig) -> Any:
    """The (pp, dp) mesh of a data-parallel run, pipeline outermost (as torchtitan's)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        torch.device(cfg.device).type, (cfg.ranks, cfg.dp), mesh_dim_names=("pp", "dp")
    )


def _mine(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's slice of the global batch (the whole batch without data parallelism)."""
    if pipe.dp_size == 1:
        return x, y
    return x.tensor_split(pipe.dp_size)[pipe.dp_rank], y.tensor_split(pipe.dp_size)[pipe.dp_rank]


# -- command line ---------------------------------------------------------------------
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
        "--data",
        default=None,
        metavar="FILE",
        help="train on a UTF-8 text file, its bytes as tokens (last tenth held out for the "
        "eval loss); default: a generated corpus",
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
    refuse_renamed(
        parser, "--layers", "--blocks", "it counts transformer blocks (a GPT block is 2 layers)"
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
        "sha256; --microbatches, --batch-size, --seed, --lr, --width and --blocks must be "
        "those it was saved with, while --ranks and --schedule (the layout), --steps (to "
        "extend the run), --checkpoint-every, --timeout, --quiet, --device and the memory "
        "flags (--group-w, --recompute, --offload, --memory-limit) may change",
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints"
    )
    parser.add_argument(
        "--timeout", type=float, default=d.timeout, help="seconds a rank waits for a peer"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")


def run_cli(args: Any) -> int:
    """Train a small GPT across pipeline ranks (the built-in demo on defaults)."""
    keys = set(TrainConfig.__dataclass_fields__)
    given = {k: v for k, v in vars(args).items() if k in keys}
    if given.get("model") is None:  # the default, unless a config file names the architecture
        given["model"] = "gpt"
        if given.get("model_config") is not None:
            from zeropipe.apps.models.hf import read_model_config

            given["model"] = read_model_config(given["model_config"])["model_type"]
    cfg = TrainConfig(**given)
    if cfg.checkpoint_every < 1:
        raise ZeropipeError("--checkpoint-every must be >= 1")
    summary = train(cfg)
    if summary["interrupted"]:
        return 130
    return 0
