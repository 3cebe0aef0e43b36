"""One rank of ``zeropipe train``: set up, the step loop, the end.

:func:`train_rank` is what every process runs (the launcher of
:mod:`zeropipe.apps.train.loop` starts them): it builds its stages of the model, the
pipeline and the optimizer, loads a resumed run's state and scores the held-out data
(:func:`_set_up`); trains, logs, evaluates and checkpoints each step until ``--steps``,
a stop every rank agreed on, or a loss or weights that turned non-finite
(:func:`_run_steps`); and sums the run up (:func:`_finish`), rank 0 also writing the
pictures and the trace.  A SIGINT or SIGTERM is a request (:class:`_StopRequest`): the
ranks agree on it at the end of the step they are running, save that step and stop.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zeropipe.apps.data.corpus import Corpus
from zeropipe.apps.data.tokens import TokenData
from zeropipe.apps.train import log as train_log
from zeropipe.apps.train import report, state
from zeropipe.apps.train import resume as train_resume
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.context_parallel import shard_sequences
from zeropipe.apps.train.workload import batch, build_model, load_corpus, loss_fn
from zeropipe.base.storage import local_tensor
from zeropipe.core.errors import PipelineError
from zeropipe.core.ir import Schedule
from zeropipe.core.simulate import Timeline
from zeropipe.runtime.launch import SAME_STOP_S
from zeropipe.runtime.pipeline import Pipeline, RuntimeOptions

__all__ = ["train_rank"]


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


@dataclass
class _RankRun:
    """What one rank trains with, built once by :func:`_set_up`."""

    cfg: TrainConfig
    world: int
    lead: bool  # rank 0: it logs, reports and draws
    out: Path
    pipe: Pipeline
    optimizer: torch.optim.Optimizer
    model: torch.nn.Module  # whole: its state_dict names are the checkpoint's keys
    modules: list[torch.nn.Module]  # the model and its stages: in eval mode to score
    corpus: Corpus | TokenData
    data: dict[str, Any] | None  # what the checkpoints record of --data's files
    log: train_log.RunLog | None  # rank 0's sinks
    start: int  # the step resumed from (0 for a new run)
    initial_eval: float
    stop: _StopRequest

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    def evaluate(self) -> float:
        """The held-out loss now (every rank takes part)."""
        return _evaluate(self.pipe, self.modules, self.corpus, self.cfg)


@dataclass
class _Progress:
    """How far the step loop got, and why it ended."""

    step: int
    trace_step: int  # the step whose timeline is kept
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # checkpoints included: the ETA's
    measured: Timeline | None = None  # the trace step's timeline, gathered on rank 0
    held_out: float | None = None  # the last eval loss in the loop: at the last step, the end's
    non_finite: dict[str, Any] | None = None  # why and where training stopped short
    stopped_by: int | None = None  # the signal the ranks agreed to stop on
    wall0: float = field(default_factory=time.perf_counter)
    last: float = 0.0  # when the previous step's record was logged

    def __post_init__(self) -> None:
        self.last = self.wall0


def _train(rank: int, world: int, cfg: TrainConfig, stop: _StopRequest) -> dict[str, Any]:
    """Set up, run the steps, report: one rank's whole run."""
    run = _set_up(rank, world, cfg, stop)
    return _finish(run, _run_steps(run))


def _set_up(rank: int, world: int, cfg: TrainConfig, stop: _StopRequest) -> _RankRun:
    """The model cut into its stages, the pipeline, the optimizer, the state a resume
    loads, rank 0's sinks, and the eval loss before the first step."""
    torch.set_num_threads(1)
    out = Path(cfg.out)
    corpus = load_corpus(cfg)
    schedule = Schedule.from_text(cfg.planned) if cfg.planned else cfg.build_schedule()
    mesh = _mesh(cfg)
    tp_mesh = mesh["tp"] if mesh is not None and cfg.tp > 1 else None
    ep_mesh = _experts_mesh(cfg, mesh)
    model_stages = schedule.num_stages - len(schedule.copies)  # dualpipe runs copies too
    stages, cut, model = build_model(cfg, corpus.vocab, model_stages, tp_mesh, ep_mesh)
    shard_sequences(stages, mesh, cfg.cp)
    pipe = Pipeline(
        stages,
        schedule,
        loss_fn=loss_fn(cfg),
        balance=cut,
        mesh=mesh if mesh is not None else (None if cfg.ranks > 1 else "local"),
        options=RuntimeOptions(seed=cfg.seed, timeout=cfg.timeout),
    )
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=cfg.lr, weight_decay=0.0)
    ckpt_root = out / "checkpoints"
    start = train_resume.resume(ckpt_root, rank, pipe, optimizer, cfg, model) if cfg.resume else 0
    log: train_log.RunLog | None = None
    scored = False  # metrics.jsonl holds the eval loss at ``start`` already
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        scored = train_resume.trim_metrics(out / "metrics.jsonl", start)
        sinks = train_log.check_loggers(cfg.log)
        log = train_log.RunLog(out, sinks, start, train_resume.run_settings(cfg))
    modules = [model, *stages]
    initial_eval = _evaluate(pipe, modules, corpus, cfg)
    if log is not None and not scored:  # a row of its own: no step trained yet
        log.step({"step": start, "eval_loss": initial_eval})
    return _RankRun(
        cfg=cfg,
        world=world,
        lead=rank == 0,
        out=out,
        pipe=pipe,
        optimizer=optimizer,
        model=model,
        modules=modules,
        corpus=corpus,
        data=corpus.record() if isinstance(corpus, TokenData) else None,
        log=log,
        start=start,
        initial_eval=initial_eval,
        stop=stop,
    )


def _run_steps(run: _RankRun) -> _Progress:
    """The steps from ``run.start`` to ``--steps``, each logged and checkpointed as due; a
    non-finite loss or weights, or an agreed stop, end them early."""
    cfg = run.cfg
    p = _Progress(step=run.start, trace_step=min(max(run.start, cfg.trace_step), cfg.steps - 1))
    while p.step < cfg.steps:
        record, stopping = _one_step(run, p)
        if record is None:  # the loss was not finite
            break
        p.held_out = None
        every = cfg.eval_every and p.step % cfg.eval_every == 0
        if (every or p.step == cfg.steps) and not stopping:  # the last step's is the end eval
            p.held_out = record["eval_loss"] = run.evaluate()  # on every rank
        _log_step(run, p, record)
        due = p.step % cfg.checkpoint_every == 0 or p.step == cfg.steps or stopping
        if due and not _save_if_finite(run, p, record["loss"]):
            break
        if stopping:
            p.stopped_by = stopping
            if run.lead:
                _stopped_line(cfg, stopping, p.step, run.ckpt_root)
            break
    return p


def _one_step(run: _RankRun, p: _Progress) -> tuple[dict[str, Any] | None, int]:
    """Train step ``p.step`` (and count it): its metrics, and the signal the ranks agreed to
    stop on (0: none).  A non-finite loss is recorded in ``p.non_finite``, and no metrics."""
    cfg, pipe = run.cfg, run.pipe
    for group in run.optimizer.param_groups:  # linear warm-up: no early loss spikes
        group["lr"] = cfg.lr * min(1.0, (p.step + 1) / cfg.warmup)
    x, y = _mine(pipe, *batch(run.corpus, cfg, p.step))
    profiled = cfg.profile and run.lead and p.step == p.trace_step
    loss, norm, elapsed = _step(pipe, run.optimizer, cfg, x, y, run.out if profiled else None)
    bubble = report.bubble_rate(pipe, elapsed, run.world)
    if p.step == p.trace_step:
        p.measured = report.gather_timeline(pipe, run.world)
    p.step += 1
    value = loss.item()
    # The loss is the same on every rank; agreeing on it anyway keeps every rank on
    # the same path even if one saw it differently.  One all-reduce for both: the
    # stop is the largest signal any rank got (SIGTERM over SIGINT), 0 for none.
    stopping, diverged = _agree([run.stop.signum, int(not math.isfinite(value))], run.world)
    if diverged:  # saving now would make a checkpoint no run should resume from
        p.non_finite = {"what": "loss", "step": p.step, "loss": value}
        return None, stopping
    p.losses.append(value)
    record: dict[str, Any] = {
        "step": p.step,
        "loss": value,
        "tokens_per_s": cfg.batch_size * cfg.seq / elapsed,
        "step_s": elapsed,
        "bubble_rate": bubble,
        "peak_saved_bytes": report.peak_bytes(pipe),
    }
    if norm is not None:
        record["grad_norm"] = norm  # before clipping
    return record, stopping


def _log_step(run: _RankRun, p: _Progress, record: dict[str, Any]) -> None:
    """Rank 0: the step's metrics to the sinks, and its progress line with the ETA."""
    if run.log is None:
        return
    cfg = run.cfg
    run.log.step(record)
    now = time.perf_counter()
    p.step_times.append(now - p.last)
    p.last = now
    if not cfg.quiet:
        eta = train_log.eta(p.step_times, cfg.steps - p.step)
        report.progress(record, cfg.steps, f" | {eta}" if eta else "")
        if p.held_out is not None and p.step < cfg.steps:  # the summary gives the last
            report.eval_line(p.step, p.held_out)


def _save_if_finite(run: _RankRun, p: _Progress, loss: float) -> bool:
    """Checkpoint step ``p.step``, unless a weight turned non-finite on some rank (then
    ``p.non_finite`` says so and nothing is saved): whether it saved."""
    # A finite loss can still be followed by an update that overflowed.
    if _agree([int(not _weights_finite(run.pipe))], run.world)[0]:
        p.non_finite = {"what": "weights", "step": p.step, "loss": loss}
        return False
    train_resume.save(run.ckpt_root, p.step, run.pipe, run.optimizer, run.cfg, run.model, run.data)
    return True


def _finish(run: _RankRun, p: _Progress) -> dict[str, Any]:
    """The run's summary; on rank 0 also the pictures, the trace and the printed summary."""
    cfg = run.cfg
    # None after a stop (whoever stopped the run is waiting for it to end) or a non-finite
    # step: the summary says there was no end eval.
    done = p.non_finite is None and p.stopped_by is None
    summary = {
        **_settings(cfg),
        "steps_run": p.step - run.start,
        "last_step": p.step,
        "initial_eval_loss": run.initial_eval,
        "final_eval_loss": p.held_out if done else None,
        "final_train_loss": p.losses[-1] if p.losses else math.nan,
        "wall_s": time.perf_counter() - p.wall0,
        "interrupted": p.stopped_by,
        "non_finite": p.non_finite,
    }
    if run.log is not None:
        run.log.close()
        if not cfg.quiet:
            print()
        summary["trace"] = report.write_pictures(run.out, run.pipe, p.measured)
        summary["trace_step"] = p.trace_step
        if not cfg.quiet and p.non_finite is None:  # train() reports a non-finite stop
            report.print_summary(summary, run.out)
    return summary


def _step(
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    cfg: TrainConfig,
    x: torch.Tensor | dict[str, torch.Tensor],
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
    """The (pp, dp, tp) mesh of a data- or tensor-parallel run, (pp, dp, cp, tp) with
    ``--cp`` (None for a pipeline alone).

    torchtitan's order: pipeline outermost, tensor parallelism innermost, so a
    tensor-parallel group is consecutive ranks (one node under torchrun).
    """
    if cfg.dp == 1 and cfg.tp == 1 and cfg.cp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    cp = ("cp",) if cfg.cp > 1 else ()
    return init_device_mesh(
        torch.device(cfg.device).type,
        (cfg.ranks, cfg.dp, *(cfg.cp,) * len(cp), cfg.tp),
        mesh_dim_names=("pp", "dp", *cp, "tp"),
    )


def _experts_mesh(cfg: TrainConfig, mesh: Any) -> Any:
    """What ``--ep N`` shards the experts over: blocks of N consecutive replicas of each
    pipeline rank (all of "dp" when N is ``--dp``); None without expert parallelism."""
    if mesh is None or cfg.ep == 1:
        return None
    if cfg.ep == cfg.dp:
        return mesh["dp"]
    from torch.distributed.device_mesh import init_device_mesh

    shape = (cfg.ranks, cfg.dp // cfg.ep, cfg.ep, cfg.tp)
    names = ("pp", "replicas", "ep", "tp")
    return init_device_mesh(torch.device(cfg.device).type, shape, mesh_dim_names=names)["ep"]


def _mine(
    pipe: Pipeline, x: torch.Tensor | dict[str, torch.Tensor], y: torch.Tensor
) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
    """This replica's slice of the global batch (the whole batch without data parallelism;
    every cp process of a replica its whole slice); a dict batch (packed documents) sliced
    entry by entry."""
    which, slices = pipe.batch_slice
    if slices == 1:
        return x, y

    def slice_(t: torch.Tensor) -> torch.Tensor:
        return t.tensor_split(slices)[which]

    mine = {k: slice_(v) for k, v in x.items()} if isinstance(x, dict) else slice_(x)
    return mine, slice_(y)
