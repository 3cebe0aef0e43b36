"""How ``zeropipe train`` saves its state and resumes from it, on the same or another layout.

    check_resume(cfg)             before any rank starts: the checkpoint verifies, and
                                  was saved by this run (model, data -- also the files'
                                  contents at the same paths --, optimisation)
    save(root, step, ...)         every rank: a DCP checkpoint (zeropipe.apps.train.state)
    resume(root, ...) -> step     every rank: load what its stages need now; the step

A checkpoint holds the model and the AdamW state by parameter name, the RNG
state and the data position as the number of samples consumed (a layout-free
number: the next batch is ``samples / batch_size``), so ``--resume`` may use
another ``--ranks``, ``--dp``, ``--tp``, ``--schedule`` or chunking than the run
that saved (tensor-parallel weights are stored at their global shapes, and
resharded on load).
Checkpoints of the older per-rank format still resume, on their own layout.

The settings come as any dataclass with the fields of
``zeropipe.apps.train.config.TrainConfig``; its defaults are ``type(cfg)()``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from zeropipe.apps.cli_args import flag_fields, flag_name
from zeropipe.apps.data.tokens import TokenData, changed_files
from zeropipe.apps.train import state as train_state
from zeropipe.apps.train.state import CheckpointError
from zeropipe.apps.train.workload import load_corpus
from zeropipe.core.errors import ZeropipeError
from zeropipe.runtime.checkpoint.dcp import load_checkpoint
from zeropipe.runtime.checkpoint.folder import FORMAT as DCP_FORMAT
from zeropipe.runtime.pipeline import Pipeline

__all__ = [
    "check_resume",
    "kept_checkpoint",
    "non_finite_message",
    "resume",
    "run_settings",
    "save",
    "trim_metrics",
]

# What makes a run the run it is: resuming with any of these changed would continue
# another run (other data, other model, other optimisation), so --resume refuses.
# The rest may change: --steps (extend a run), --checkpoint-every, --timeout, --quiet,
# --out (a moved folder), --device, how a step is executed (--group-w, --recompute,
# --offload, --memory-limit, --checkpoint-blocks), which changes memory and time, not the
# losses beyond float rounding, and the layout (--schedule, --ranks, --dp, --tp): a DCP checkpoint is
# keyed by the model's names and holds every tensor at its global shape (a tensor-parallel
# weight as its shards), and each process reads what its stages now need, cut as it cuts them.
_MUST_MATCH = (
    "model",
    "model_config",
    "data",
    "tokenizer",
    "text_field",
    "microbatches",
    "batch_size",
    "seed",
    "lr",
    "warmup",
    "width",
    "blocks",
    "heads",
    "seq",
    "dropout",
    "clip",
)
# Older per-rank checkpoints fit only the layout they were saved from.
_LAYOUT = ("schedule", "ranks", "tp")
# Settings that checkpoints recorded under another name: field -> the older key.
_OLD_KEYS = {"blocks": "layers"}  # --layers counted blocks, and became --blocks


# Fields that say how this invocation runs, not what the run is: not recorded.
_NOT_SETTINGS = ("out", "resume", "planned", "overwrite", "log")


def _flag(config_type: type, name: str) -> str:
    """How a setting is told: as its flag, or as the field that only the Python API sets."""
    flags = {f.name for f in flag_fields(config_type)}
    return flag_name(name) if name in flags else f"TrainConfig.{name}"


def run_settings(cfg: Any) -> dict[str, Any]:
    """The settings a checkpoint records (JSON): every field but where it lives and the plan."""
    return {k: v for k, v in asdict(cfg).items() if k not in _NOT_SETTINGS}


def check_resume(cfg: Any, warn: bool = True) -> None:
    """Verify the checkpoint ``cfg.resume`` would load, and that it was saved by this run.

    Raises a one-line :class:`CheckpointError` for a corrupt file and a
    :class:`ZeropipeError` naming every setting that differs from the saved
    one.  A checkpoint from before checksums existed is loaded unverified,
    with a warning on stderr (``warn``).
    """
    root = Path(cfg.out) / "checkpoints"
    step, why = train_state.newest_complete(root)
    if why is not None and warn:
        print(
            f"zeropipe: {why}; resuming from {train_state.step_dir(root, step or 0).name}, "
            f"the newest complete checkpoint",
            file=sys.stderr,
        )
    manifest = train_state.verify(root)  # the same checkpoint: newest_complete decides both
    _metric_rows(Path(cfg.out) / "metrics.jsonl")  # a bad row is refused before any rank starts
    if manifest is None:
        if warn:
            print(
                f"zeropipe: warning: {root / 'latest'} names a checkpoint written before "
                f"checkpoints carried checksums and settings: it is loaded unverified, and the "
                f"flags are not compared with those it was saved with",
                file=sys.stderr,
            )
        _check_steps(root, train_state.latest_step(root), cfg)
        return
    saved = manifest.meta.get("config")
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"{train_state.step_dir(root, manifest.step) / train_state.MANIFEST} records no run "
            f"settings; resume with the zeropipe that wrote it, or start a new --out"
        )
    default = type(cfg)()
    layout_free = manifest.format == DCP_FORMAT
    told, fix = _model_source(cfg, saved)
    # --model-path sets --model, --model-config and (with --data) --tokenizer: a different
    # folder is told as the folder, not as flags the user never gave.
    implied = ("model", "model_config", "tokenizer") if told else ()
    differ = []
    for name in _MUST_MATCH + (() if layout_free else _LAYOUT):
        key = name if name in saved else _OLD_KEYS.get(name, name)
        now, then = getattr(cfg, name), saved.get(key, getattr(default, name))
        if now != then and not (name in implied and _implied(name, cfg, saved)):
            differ.append((_flag(type(cfg), name), now, then))
    if not differ and not told:
        _check_steps(root, manifest.step, cfg)
        _check_data(cfg, manifest.meta.get("data"), train_state.step_dir(root, manifest.step))
        return
    told += [f"{flag} {now} differs from the checkpoint's {then}" for flag, now, then in differ]
    fix += [
        f"{flag}={then}"
        if flag.startswith("TrainConfig")
        else (f"no {flag}" if then is None else f"{flag} {then}")
        for flag, _, then in differ
    ]
    layout = (
        " (a checkpoint in the older per-rank format resumes only on the layout that saved it)"
        if {"--schedule", "--ranks", "--tp"} & {flag for flag, _, _ in differ}
        else ""
    )
    raise ZeropipeError(
        f"--resume: {', '.join(told)}{layout}; pass {' '.join(fix)} or start a new --out "
        f"(checkpoint {train_state.step_dir(root, manifest.step)})"
    )


def _model_source(cfg: Any, saved: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Where the model came from, told in the flags given, when --model-path differs from the
    checkpoint's: (what differs, the flags to pass); two empty lists when it does not."""
    then_path, now_path = saved.get("model_path"), getattr(cfg, "model_path", None)
    if then_path == now_path:
        return [], []
    if then_path is not None:
        return [f"this run was trained from --model-path {then_path}"], [
            f"--model-path {then_path}"
        ]
    then = (
        f"--model-config {saved['model_config']}"
        if saved.get("model_config")
        else f"--model {saved.get('model', 'gpt')}"
    )
    return [f"this run was trained from {then}, not from --model-path {now_path}"], [
        f"{then} without --model-path"
    ]


def _implied(name: str, cfg: Any, saved: dict[str, Any]) -> bool:
    """Whether a differing setting is one --model-path set (on either side), not one given."""
    if name != "tokenizer":
        return True
    # The tokenizer differs only as the folders' own tokenizers do.
    paths = (saved.get("model_path"), getattr(cfg, "model_path", None))
    return saved.get("tokenizer") in paths and cfg.tokenizer in paths


def _check_data(cfg: Any, record: Any, folder: Path) -> None:
    """The --data files at the same paths hold what the run was trained on: grown, cut or
    rewritten, their batches and held-out windows would move under the resumed run."""
    if cfg.data is None or not isinstance(record, dict) or "sha256" not in record:
        return  # the generated corpus, or a checkpoint from before its data was recorded
    now = load_corpus(cfg)
    if not isinstance(now, TokenData) or now.sha256 == record["sha256"]:
        return
    told = changed_files(record.get("sources", []), now.sources)
    what = (
        "; ".join(told)
        if told
        else "its files are unchanged but their tokens differ (was the --tokenizer rewritten?)"
    )
    raise ZeropipeError(
        f"--resume: --data changed since checkpoint {folder} was saved: {what} "
        f"({record.get('tokens', 0):,} tokens then, {now.tokens.numel():,} now), which would "
        f"move the batches and the held-out windows; restore the data, or start a new run "
        f"with another --out (or --overwrite)"
    )


def _check_steps(root: Path, step: int | None, cfg: Any) -> None:
    """A resume that would train nothing is a mistake in --steps, not a run to report done."""
    if step is not None and cfg.steps <= step:
        raise ZeropipeError(
            f"--resume: the checkpoint is at step {step}; --steps {cfg.steps} must be above it "
            f"to train more (checkpoint {train_state.step_dir(root, step)})"
        )


def kept_checkpoint(cfg: Any) -> str:
    """What a run that ended early left to resume from, in words."""
    root = Path(cfg.out) / "checkpoints"
    kept = _kept(root, "names")
    if kept is None:
        return f"no checkpoint was saved in {root}"
    return f"{kept}; run the same command with --resume to go on from it"


def _kept(root: Path, names: str) -> str | None:
    """Which checkpoint a resume would start from, in words: the one ``latest`` ``names``,
    or the newest complete one where ``latest`` is gone; None when there is none."""
    latest, why = train_state.newest_complete(root)
    if latest is None:
        return None
    folder = train_state.step_dir(root, latest).name
    return f"{root / 'latest'} {names} {folder}" if why is None else f"{why}: {folder} is kept"


def save(
    root: Path,
    step: int,
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    cfg: Any,
    model: torch.nn.Module,
    data: dict[str, Any] | None = None,
) -> None:
    """The checkpoint of ``step`` (every rank calls it); ``latest`` moves once it is complete.
    ``data``: what the run trains on (:meth:`TokenData.record`), checked on resume."""
    extra = {"step": step, "samples": step * cfg.batch_size, "rng": torch.get_rng_state()}
    meta: dict[str, Any] = {"config": run_settings(cfg)}
    if data is not None:
        meta["data"] = data
    train_state.save_step(root, step, pipe, optimizer, extra=extra, meta=meta, model=model)


def resume(
    root: Path,
    rank: int,
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    cfg: Any,
    model: torch.nn.Module,
) -> int:
    """Load the newest complete checkpoint into this rank's stages and optimizer; the step
    to continue from.  A checkpoint that does not fit the model is a :class:`CheckpointError`."""
    manifest = train_state.read_manifest(root)
    if manifest is None or manifest.format != DCP_FORMAT:
        return _resume_per_rank(root, rank, pipe, optimizer)
    folder = train_state.step_dir(root, manifest.step)
    extra = load_checkpoint(pipe, optimizer, folder, model=model)
    if not isinstance(extra, dict) or not {"samples", "rng"} <= extra.keys():
        raise CheckpointError(
            f"{folder} holds no training position (samples, rng): it was not saved by "
            f"zeropipe train; start a new --out"
        )
    samples = int(extra["samples"])
    if samples % cfg.batch_size:
        raise CheckpointError(
            f"{folder} was saved after {samples} samples, not a whole number of "
            f"--batch-size {cfg.batch_size} batches; resume with the batch size it was saved with"
        )
    torch.set_rng_state(extra["rng"])
    return samples // cfg.batch_size


def _resume_per_rank(
    root: Path, rank: int, pipe: Pipeline, optimizer: torch.optim.Optimizer
) -> int:
    state = train_state.load_rank(root, rank)
    try:
        for s, sd in state["stages"].items():
            pipe.stages[int(s)].module.load_state_dict(sd)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        return int(state["step"])
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        # check_resume compared the settings already, but a checkpoint from before they
        # were recorded can still be of another model.  load_state_dict's first line is
        # a heading ("Error(s) in ...:"); the first line under it says what differs.
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        first = next((ln for ln in lines if not ln.endswith(":")), type(exc).__name__)
        raise CheckpointError(
            f"the checkpoint in {root} does not fit this model ({first}); resume "
            f"with the flags it was saved with, or start a new --out"
        ) from None


def non_finite_message(event: dict[str, Any], cfg: Any) -> str:
    """The one line ``zeropipe train`` ends with when the loss or the weights turn non-finite."""
    root = Path(cfg.out) / "checkpoints"
    step = event["step"]
    if event["what"] == "loss":
        what = f"the training loss became non-finite ({event['loss']}) at step {step}"
    else:
        what = (
            f"the weights became non-finite in the update of step {step} "
            f"(its loss, {event['loss']:.4g}, was still finite)"
        )
    kept = _kept(root, "still names") or f"no checkpoint was saved in {root}"
    return (
        f"{what}; stopped without saving it: {kept}. Resuming would repeat it (resume is "
        f"exact): lower --lr (it is {cfg.lr:g}) and start a new --out"
    )


def trim_metrics(path: Path, start: int) -> bool:
    """On resume, drop metrics of steps after the checkpoint (they will be redone); whether
    a row kept holds the eval loss at step ``start`` (a run that ended there scored it).

    A torn last line (a run killed, or a disk filled, while writing it) is dropped with a
    note on stderr; a bad line before it is refused (:func:`_metric_rows`).  The file is
    rewritten whole or not at all, so a kill here loses no row.
    """
    if not path.exists():
        return False
    if start == 0:
        path.unlink()
        return False
    rows, torn = _metric_rows(path)
    if torn is not None:
        print(
            f"zeropipe train: dropped the torn last line of {path} (line {torn}: cut short "
            f"as a killed run or a full disk leaves it)",
            file=sys.stderr,
        )
    keep = [(line, row) for line, row in rows if row["step"] <= start]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_bytes(b"".join(line + b"\n" for line, _ in keep))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return any(row["step"] == start and "eval_loss" in row for _, row in keep)


def _metric_rows(path: Path) -> tuple[list[tuple[bytes, dict[str, Any]]], int | None]:
    """metrics.jsonl's rows (each line as written, and read), and the number of its last
    line when that line is torn (not a row: left out).  A line before it that is not a row
    did not come from a crash: a :class:`ZeropipeError` names it."""
    if not path.exists():
        return [], None
    numbered = [(n, line) for n, line in enumerate(path.read_bytes().split(b"\n"), 1)]
    numbered = [(n, line) for n, line in numbered if line.strip()]
    rows = []
    for i, (number, line) in enumerate(numbered):
        row = _metric_row(line)
        if row is not None:
            rows.append((line, row))
        elif i == len(numbered) - 1:
            return rows, number
        else:
            raise ZeropipeError(
                f"--resume: {path}, line {number} is not a metrics row (a JSON object with an "
                f"integer step), and only a last line is torn by a crash; remove that line, or "
                f"start the run over with --overwrite"
            )
    return rows, None


def _metric_row(line: bytes) -> dict[str, Any] | None:
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return row if isinstance(step, int) and not isinstance(step, bool) else None
