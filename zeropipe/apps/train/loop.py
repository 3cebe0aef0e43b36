"""``zeropipe train``: a small GPT (or a Hugging Face causal LM) trained across pipeline ranks.

One call of :func:`train` spawns ``ranks x dp x cp x tp`` processes over gloo (or,
under torchrun, runs as the rank it was started as; :func:`layout` says it in
words and the run's first line prints it), trains the GPT of
:mod:`zeropipe.apps.models.gpt` (``--model gpt``, the default) or a Hugging Face
model of :mod:`zeropipe.apps.models.hf_presets` cut by :func:`zeropipe.adapters.split.split`
(``--model llama|qwen3|gpt2``, ``--model-config FILE.json``) on the generated
corpus of :mod:`zeropipe.apps.data.corpus` (or ``--data``'s documents, tokenized and packed by
:mod:`zeropipe.apps.data.tokens`, held-out windows scored every ``--eval-every`` steps) under the
chosen schedule -- :mod:`zeropipe.apps.train.workload` builds the model, its cut, its
loss and its batches; with ``--tp`` > 1 it is tensor-parallel over the "tp" dimension
of a (pp, dp, tp) mesh, with ``--cp`` > 1 its sequences sharded over a "cp" dimension
(:mod:`zeropipe.apps.train.context_parallel`) -- and leaves in ``--out``::

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

(Each process runs :func:`zeropipe.apps.train.rank.train_rank`;
:mod:`zeropipe.apps.train.report` measures, prints and draws what a run reports.)

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
import os
import signal
import sys
from pathlib import Path
from typing import Any

from zeropipe.apps.data.tokens import TokenData
from zeropipe.apps.train import lock as run_lock
from zeropipe.apps.train import log as train_log
from zeropipe.apps.train import resume as train_resume
from zeropipe.apps.train import state
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.rank import train_rank
from zeropipe.apps.train.resume import check_resume
from zeropipe.apps.train.workload import load_corpus, model_size
from zeropipe.core.errors import ZeropipeError

__all__ = ["layout", "processes", "run_cli", "train"]


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
        if world % (cfg.dp * cfg.cp * cfg.tp):
            shared = f"--dp {cfg.dp} replicas" + (f" of --tp {cfg.tp}" if cfg.tp > 1 else "")
            shared += f" x --cp {cfg.cp}" if cfg.cp > 1 else ""
            raise ZeropipeError(f"torchrun started {world} processes, which {shared} cannot share")
        if world != cfg.ranks * cfg.dp * cfg.cp * cfg.tp:
            cfg.ranks = world // (cfg.dp * cfg.cp * cfg.tp)
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
    """The processes a run takes: pipeline ranks x replicas x context-parallel x
    tensor-parallel processes."""
    return cfg.ranks * cfg.dp * cfg.cp * cfg.tp


def layout(cfg: TrainConfig) -> str:
    """The run's layout in words, e.g. 'pp 2 x dp 1 x tp 2 = 4 processes'; with --ep, the
    experts sharded over the replicas ('pp 2 x dp 2 (experts over dp: ep 2) x tp 1 = 4
    processes')."""
    n = processes(cfg)
    ep = f" (experts over dp: ep {cfg.ep})" if cfg.ep > 1 else ""
    cp = f" x cp {cfg.cp}" if cfg.cp > 1 else ""
    return f"pp {cfg.ranks} x dp {cfg.dp}{ep}{cp} x tp {cfg.tp} = {n} process{'es' * (n != 1)}"


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
