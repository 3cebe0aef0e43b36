"""``zeropipe train``: a small GPT (or a Hugging Face causal LM) trained across pipeline ranks.

One call of :func:`train` spawns ``ranks x dp x tp`` processes over gloo (or,
under torchrun, runs as the rank it was started as; :func:`layout` says it in
words and the run's first line prints it), trains the GPT of
:mod:`zeropipe.apps.models.gpt` (``--model gpt``, the default) or a Hugging Face
model of :mod:`zeropipe.apps.models.hf_presets` cut by :func:`zeropipe.adapters.split.split`
(``--model llama|qwen3|gpt2``, ``--model-config FILE.json``) on the generated
corpus of :mod:`zeropipe.apps.data.corpus` (or ``--data``'s documents, tokenized and packed by
:mod:`zeropipe.apps.data.tokens`, held-out windows scored every ``--eval-every`` steps) under the
chosen schedule -- :mod:`zeropipe.apps.train.workload` builds the model, its cut, its
loss and its batches; with ``--tp`` > 1 it is tensor-parallel over the "tp" dimension
of a (pp, dp, tp) mesh -- and leaves in ``--out``::

    metrics.jsonl      one JSON object per step: step, loss, tokens_per_s, ... (and
                       eval_loss every --eval-every steps and at the last); the eval loss
                       at the start is a row of its own, {"step": 0, "eval_loss": ...}
    checkpoints/       the last complete checkpoints, in torch's distributed checkpoint
                       format (see zeropipe.apps.train.state and zeropipe.apps.train.resume)
    timeline.png       the planned (simulated) and measured timelines of one step
    trace.json         Chrome trace of that measured step (opens in Perfetto)
    torch_trace.json   with --profile: rank 0's torch profiler trace of that step (its
                       actions named as torch.distributed.pipelining names them, PP:1F3)
    loss.png           the training loss curve, and the eval losses on it
    tensorboard/       with --log tensorboard: loss, eval loss, tokens/s, bubble per step
    wandb/             with --log wandb: the same, as an offline wandb run

The launcher holds ``--out``'s lock (:mod:`zeropipe.apps.train.lock`) for the
whole run, so a second run on the same folder is refused at once.  An ``--out``
that already holds a run (metrics.jsonl or checkpoints/) is refused unless
``--resume`` continues it or ``--overwrite`` replaces it (removing only what a
run writes: the files above, and in its folders only entries of their names);
an ``--out`` inside a checkpoint folder is refused.  ``--config FILE.toml`` gives the flags'
settings from a file, the flags on the command line overriding it; rank 0
prints the layout, the model's size and, resumed, the checkpoint it continues
from, then a progress line with an ETA (:mod:`zeropipe.apps.train.log`).

(:mod:`zeropipe.apps.train.report` measures, prints and draws what a run reports.)

Stopping: Ctrl-C (SIGINT, which a terminal sends to the launcher and every
rank) or SIGTERM (to the launcher, which passes it on, or to every process,
as a job scheduler does) is turned into a request that all ranks agree on at
the end of the step they are running: they finish it, save a checkpoint of
it, the launcher waits for them (up to twice ``--timeout``) and the command
exits 130 after SIGINT, 143 after SIGTERM (128 + the signal, as a shell
reports a process the signal ended), printing where it saved.  A second
Ctrl-C ends the ranks at once, unsaved.  A job started in the background by
a non-interactive shell ignores SIGINT (POSIX), and so does the run: stop it
with SIGTERM.  ``--resume``
continues from the newest complete checkpoint, reading exactly the batches
an uninterrupted run would have read, so its losses are the same -- also on
another ``--ranks``, ``--dp``, ``--tp`` or ``--schedule`` (the checkpoint is keyed
by the model's parameter names and holds each tensor at its global shape).  Before any rank starts, it checks the checkpoint's files
against their sha256 and the settings it was saved with against the flags
(:func:`check_resume`).  ``zeropipe export`` writes a checkpoint's model as
one safetensors file.

A non-finite loss, or non-finite weights about to be saved, stop every rank
at once without saving: ``latest`` keeps naming the last finite checkpoint,
and :func:`train` raises one line naming the step.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeropipe.apps.data.corpus import Corpus
from zeropipe.apps.data.tokens import TokenData
from zeropipe.apps.train import lock as run_lock
from zeropipe.apps.train import log as train_log
from zeropipe.apps.train import report, state
from zeropipe.apps.train import resume as train_resume
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.resume import check_resume
from zeropipe.apps.train.workload import (
    batch,
    build_model,
    load_corpus,
    loss_fn,
    model_size,
)
from zeropipe.base.storage import local_tensor
from zeropipe.core.errors import PipelineError, ZeropipeError
from zeropipe.core.ir import Schedule
from zeropipe.core.simulate import Timeline
from zeropipe.runtime.launch import SAME_STOP_S
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

__all__ = ["layout", "processes", "run_cli", "train", "train_rank"]


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run the training job; returns rank 0's summary.

    With ``resume``, the checkpoint is verified and the settings it was saved
    with compared with ``cfg`` before any rank starts (one-line errors).  A
    loss or weights that turn non-finite end the run, unsaved, with a
    :class:`ZeropipeError` naming the step.
    """
    cfg.check()
    train_log.check_loggers(cfg.log)
    _make_out(cfg)
    # The run folder is this run's from the first moment: a second run on it is refused
    # before either reads or writes anything there (under torchrun, RANK 0 holds it).
    owner = os.environ.get("RANK", "0") == "0"
    with run_lock.claim_run_dir(cfg.out) if owner else contextlib.nullcontext():
        if owner or not cfg.overwrite:
            train_log.check_run_dir(cfg.out, cfg.resume, cfg.overwrite)
        summary = _launch(cfg)
    if summary.get("non_finite") is not None:
        raise ZeropipeError(train_resume.non_finite_message(summary["non_finite"], cfg))
    return summary


def _launch(cfg: TrainConfig) -> dict[str, Any]:
    """The ranks started (by torchrun, in this process, or spawned) and rank 0's summary."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        from zeropipe.runtime.launch import init_from_env

        rank, world = init_from_env(timeout=cfg.timeout)
        if world % (cfg.dp * cfg.tp):
            shared = f"--dp {cfg.dp} replicas" + (f" of --tp {cfg.tp}" if cfg.tp > 1 else "")
            raise ZeropipeError(f"torchrun started {world} processes, which {shared} cannot share")
        if world != cfg.ranks * cfg.dp * cfg.tp:
            cfg.ranks = world // (cfg.dp * cfg.tp)
        if cfg.resume:
            check_resume(cfg, warn=rank == 0)
        if rank == 0:
            _announce(cfg)
        summary = train_rank(rank, world, cfg)
    elif processes(cfg) == 1:
        if cfg.resume:
            check_resume(cfg)
        _announce(cfg)
        summary = train_rank(0, 1, cfg)
    else:
        from zeropipe.runtime.launch import launch

        if cfg.resume:
            check_resume(cfg)
        _announce(cfg)
        results = launch(
            train_rank,
            processes(cfg),
            cfg,
            timeout=cfg.timeout * 4 + cfg.steps * 5.0,
            threads=1,
            # A stop finishes the step and saves it, each bounded by --timeout's waits.
            stop_wait=2 * cfg.timeout,
        )
        summary = results[0]
    return summary


def processes(cfg: TrainConfig) -> int:
    """The processes a run takes: pipeline ranks x replicas x tensor-parallel processes."""
    return cfg.ranks * cfg.dp * cfg.tp


def layout(cfg: TrainConfig) -> str:
    """The run's layout in words, e.g. 'pp 2 x dp 1 x tp 2 = 4 processes'."""
    n = processes(cfg)
    return f"pp {cfg.ranks} x dp {cfg.dp} x tp {cfg.tp} = {n} process{'es' * (n != 1)}"


def _announce(cfg: TrainConfig) -> None:
    """The start-up lines: what trains, on which layout, the model's size, and where a resumed
    run continues from (rank 0 only; not under --quiet)."""
    if cfg.quiet:
        return
    print(f"zeropipe train: {cfg.model} on {layout(cfg)}, schedule {cfg.schedule}")
    corpus = load_corpus(cfg)
    params, nbytes = model_size(cfg, corpus.vocab)
    print(f"zeropipe train: {train_log.model_line(params, nbytes, cfg.seq, corpus.vocab)}")
    if isinstance(corpus, TokenData):
        print(f"zeropipe train: {corpus.describe()}")
    if cfg.resume:
        root = Path(cfg.out) / "checkpoints"
        step = state.latest_step(root)
        if step is not None:
            print(f"zeropipe train: resumed from step {step} ({state.step_dir(root, step)})")
    sys.stdout.flush()  # before the ranks' output


def _make_out(cfg: TrainConfig) -> None:
    """``--out`` made (if new) and writable here, before any rank trains into it."""
    out = cfg.out
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ZeropipeError(
            f"--out {out} cannot be made ({exc.strerror or exc}); give a folder you can write"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ZeropipeError(f"--out {out} is not writable; give a folder you can write")


def train_rank(rank: int, world: int, cfg: TrainConfig) -> dict[str, Any]:
    """The training loop as one rank runs it (also the whole job when ranks == 1).

    SIGINT and SIGTERM, from the moment it starts, ask it to stop after the
    step it is running (see the module's docstring); the handlers that were
    there before come back when it returns.
    """
    # First thing: a signal during the model's construction is a request too, not
    # a KeyboardInterrupt that would end this rank alone.
    stop = _StopRequest(abort_on_repeat=world == 1)
    try:
        return _train(rank, world, cfg, stop)
    finally:
        stop.restore()


def _train(rank: int, world: int, cfg: TrainConfig, stop: _StopRequest) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = Path(cfg.out)
    ckpt_root = out / "checkpoints"
    lead = rank == 0
    corpus = load_corpus(cfg)
    schedule = Schedule.from_text(cfg.planned) if cfg.planned else cfg.build_schedule()
    mesh = _mesh(cfg)
    tp_mesh = mesh["tp"] if mesh is not None and cfg.tp > 1 else None
    stages, cut, model = build_model(cfg, corpus.vocab, schedule.num_stages, tp_mesh)
    pipe = Pipeline(
        stages,
        schedule,
        loss_fn=loss_fn(cfg),
        balance=cut,
        mesh=mesh if mesh is not None else (None if cfg.ranks > 1 else "local"),
        options=RuntimeOptions(seed=cfg.seed, timeout=cfg.timeout),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr, weight_decay=0.0)
    start = train_resume.resume(ckpt_root, rank, pipe, optimizer, cfg, model) if cfg.resume else 0
    log: train_log.RunLog | None = None
    scored = False  # metrics.jsonl holds the eval loss at ``start`` already
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        scored = train_resume.trim_metrics(out / "metrics.jsonl", start)
        sinks = train_log.check_loggers(cfg.log)
        log = train_log.RunLog(out, sinks, start, train_resume.run_settings(cfg))
    tokens = cfg.batch_size * cfg.seq
    # What the checkpoints record of the data: a resume on changed files is refused.
    data = corpus.record() if isinstance(corpus, TokenData) else None
    initial_eval = _evaluate(pipe, [model, *stages], corpus, cfg)
    if log is not None and not scored:  # a row of its own: no step trained yet
        log.step({"step": start, "eval_loss": initial_eval})
    step_times: list[float] = []  # wall time of each step, checkpoints included: the ETA's
    losses: list[float] = []
    trace_step = min(max(start, cfg.trace_step), cfg.steps - 1)
    measured: Timeline | None = None
    wall0 = last = time.perf_counter()
    step = start
    non_finite: dict[str, Any] | None = None  # why and where training stopped short
    stopped_by: int | None = None  # the signal the ranks agreed to stop on
    held_out: float | None = None  # the last eval loss in the loop: the end eval at the last step
    while step < cfg.steps:
        for group in optimizer.param_groups:  # linear warm-up: no early loss spikes
            group["lr"] = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
        x, y = _mine(pipe, *batch(corpus, cfg, step))
        profiled = cfg.profile and lead and step == trace_step
        loss, norm, elapsed = _step(pipe, optimizer, cfg, x, y, out if profiled else None)
        bubble = report.bubble_rate(pipe, elapsed, world)
        if step == trace_step:
            measured = report.gather_timeline(pipe, world)
        step += 1
        value = loss.item()
        # The loss is the same on every rank; agreeing on it anyway keeps every rank on
        # the same path even if one saw it differently.  One all-reduce for both: the
        # stop is the largest signal any rank got (SIGTERM over SIGINT), 0 for none.
        stopping, diverged = _agree([stop.signum, int(not math.isfinite(value))], world)
        if diverged:  # saving now would make a checkpoint no run should resume from
            non_finite = {"what": "loss", "step": step, "loss": value}
            break
        losses.append(value)
        record: dict[str, Any] = {
            "step": step,
            "loss": value,
            "tokens_per_s": tokens / elapsed,
            "step_s": elapsed,
            "bubble_rate": bubble,
            "peak_saved_bytes": report.peak_bytes(pipe),
        }
        if norm is not None:
            record["grad_norm"] = norm  # before clipping
        held_out = None
        every = cfg.eval_every and step % cfg.eval_every == 0
        if (every or step == cfg.steps) and not stopping:  # the last step's is the end eval
            held_out = record["eval_loss"] = _evaluate(
                pipe, [model, *stages], corpus, cfg
            )  # on every rank
        if log is not None:
            log.step(record)
            now = time.perf_counter()
            step_times.append(now - last)
            last = now
            if not cfg.quiet:
                eta = train_log.eta(step_times, cfg.steps - step)
                report.progress(record, cfg.steps, f" | {eta}" if eta else "")
                if held_out is not None and step < cfg.steps:  # the summary gives the last
                    report.eval_line(step, held_out)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps or stopping:
            # A finite loss can still be followed by an update that overflowed.
            if _agree([int(not _weights_finite(pipe))], world)[0]:
                non_finite = {"what": "weights", "step": step, "loss": value}
                break
            train_resume.save(ckpt_root, step, pipe, optimizer, cfg, model, data)
        if stopping:
            stopped_by = stopping
            if lead:
                _stopped_line(cfg, stopping, step, ckpt_root)
            break
    # None after a stop (whoever stopped the run is waiting for it to end) or a non-finite
    # step: the summary says there was no end eval.
    done = non_finite is None and stopped_by is None
    summary = {
        **_settings(cfg),
        "steps_run": step - start,
        "last_step": step,
        "initial_eval_loss": initial_eval,
        "final_eval_loss": held_out if done else None,
        "final_train_loss": losses[-1] if losses else math.nan,
        "wall_s": time.perf_counter() - wall0,
        "interrupted": stopped_by,
        "non_finite": non_finite,
    }
    if log is not None:
        log.close()
        if not cfg.quiet:
            print()
        summary["trace"] = report.write_pictures(out, pipe, measured)
        summary["trace_step"] = trace_step
        if not cfg.quiet and non_finite is None:  # train() reports a non-finite stop
            report.print_summary(summary, out)
    return summary


def _step(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    x: torch.Tensor,
    y: torch.Tensor,
    profile_to: Path | None,
) -> tuple[torch.Tensor, float | None, float]:
    """One step: the pipeline's, clipping, the optimizer's; its loss, gradient norm (before
    clipping) and seconds.  With ``profile_to``, its torch profiler trace is written there."""
    with report.torch_profile(profile_to is not None, cfg.device) as prof:
        t0 = time.perf_counter()
        loss = pipe.step(x, y)
        norm = None if cfg.clip is None else pipe.clip_grad_norm_(cfg.clip).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
    if prof is not None and profile_to is not None:
        prof.export_chrome_trace(str(profile_to / "torch_trace.json"))
    return loss, norm, elapsed


def _stopped_line(cfg: TrainConfig, signum: int, step: int, ckpt_root: Path) -> None:
    """Rank 0's line for a run stopped by a signal: where it saved, how to go on."""
    below_bar = "" if cfg.quiet else "\n"  # the progress line may lack its end
    print(
        f"{below_bar}zeropipe: stopped by {signal.Signals(signum).name} after step "
        f"{step} of {cfg.steps}: saved {state.step_dir(ckpt_root, step)}; "
        f"run the same command with --resume to go on",
        flush=True,
    )


def _settings(cfg: TrainConfig) -> dict[str, Any]:
    """What the summary says of the run's layout."""
    return {
        "model": cfg.model,
        "schedule": cfg.schedule,
        "group_w": cfg.group_w,
        "ranks": cfg.ranks,
        "dp": cfg.dp,
        "tp": cfg.tp,
    }


class _StopRequest:
    """SIGINT or SIGTERM records the signal; the ranks agree on it at the next step boundary.

    Installed from the main thread only (Python's rule for signal handlers),
    and not for a signal this process ignores.  Under a launcher a repeat is
    the same request (a terminal's Ctrl-C reaches a rank, and the launcher
    passes it on too; a second Ctrl-C is the launcher's to act on); alone
    (``abort_on_repeat``) a second signal raises KeyboardInterrupt.
    """

    def __init__(self, abort_on_repeat: bool) -> None:
        self.signum = 0
        self._at = 0.0
        self._abort_on_repeat = abort_on_repeat
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.signum and self._abort_on_repeat and now - self._at >= SAME_STOP_S:
            raise KeyboardInterrupt
        if not self.signum:
            self.signum, self._at = signum, now

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}


def _agree(values: list[int], world: int) -> list[int]:
    """Each value, the largest any rank holds (a flag: true on every rank if true on any)."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(v) for v in t.tolist()]


def _weights_finite(pipe: Pipeline) -> bool:
    # A tensor-parallel weight's shard: what this process would save (_agree asks every one).
    return all(bool(torch.isfinite(local_tensor(p)).all()) for p in pipe.parameters())


def _evaluate(
    pipe: Pipeline, modules: list[torch.nn.Module], corpus: Corpus | TokenData, cfg: TrainConfig
) -> float:
    """The mean loss of ``--eval-batches`` held-out batches, ``modules`` (the model and its
    stages) in eval mode: no dropout, so the eval loss is the model's, as
    ``from_pretrained(...).eval()`` scores it."""
    total = 0.0
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        for k in range(cfg.eval_batches):
            x, y = _mine(pipe, *batch(corpus, cfg, k, "val"))
            loss = pipe.eval_step(x, y)
            if not isinstance(loss, torch.Tensor):
                raise PipelineError("evaluation produced no loss")
            total += loss.item()
    finally:
        for m, mode in zip(modules, modes, strict=True):
            m.train(mode)
    return total / cfg.eval_batches


def _mesh(cfg: TrainConfig) -> Any:
    """The (pp, dp, tp) mesh of a data- or tensor-parallel run (None for a pipeline alone).

    torchtitan's order: pipeline outermost, tensor parallelism innermost, so a
    tensor-parallel group is consecutive ranks (one node under torchrun).
    """
    if cfg.dp == 1 and cfg.tp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        torch.device(cfg.device).type,
        (cfg.ranks, cfg.dp, cfg.tp),
        mesh_dim_names=("pp", "dp", "tp"),
    )


def _mine(pipe: Pipeline, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's slice of the global batch (the whole batch without data parallelism)."""
    if pipe.dp_size == 1:
        return x, y
    return x.tensor_split(pipe.dp_size)[pipe.dp_rank], y.tensor_split(pipe.dp_size)[pipe.dp_rank]


# -- command line ---------------------------------------------------------------------


def run_cli(args: Any) -> int:
    """Train a small GPT across pipeline ranks (the built-in demo on defaults)."""
    given = train_log.settings_from(args, TrainConfig)
    if given.get("model") is None:  # the default, unless a config file names the architecture
        given["model"] = "gpt"
        if given.get("model_config") is not None:
            from zeropipe.apps.models.hf_presets import read_model_config

            given["model"] = read_model_config(given["model_config"])["model_type"]
    cfg = TrainConfig(**given)
    try:
        summary = train(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C, or ranks that a stop ended before they saved
        print(
            f"zeropipe: interrupted before the ranks saved; {train_resume.kept_checkpoint(cfg)}",
            file=sys.stderr,
        )
        return 128 + signal.SIGINT
    if summary["interrupted"]:
        return 128 + int(summary["interrupted"])  # as a shell reports the signal's end
    return 0
