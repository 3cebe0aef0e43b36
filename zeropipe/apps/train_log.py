"""Around ``zeropipe train``'s loop: its run folder, its start-up lines, its ETA, where its
metrics go, and its settings file.

    check_run_dir(out, resume, overwrite)  an existing run in --out is refused unless resumed
                                           or overwritten; --overwrite clears zeropipe's files
    check_loggers(spec)                    --log's sinks, refused at start-up if one's package
                                           is missing
    model_line(params, nbytes, seq, vocab) the start-up line of the model's size
    eta(step_times, remaining)             "ETA 1m05s": remaining steps x median step time
    RunLog(out, sinks, start, settings)    one step's metrics to metrics.jsonl, TensorBoard
                                           (<out>/tensorboard) and wandb (offline, <out>/wandb)
    add_run_arguments(parser, config_type) --overwrite, --log, --config
    settings_from(args, config_type)       the flags given, over a --config FILE.toml

A flag given on the command line overrides the file: :func:`add_run_arguments`
marks every default, so :func:`settings_from` can tell a flag left out from one
given with its default value.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import os
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zeropipe.apps.train_resume import NOT_FLAGS
from zeropipe.core.errors import ZeropipeError

__all__ = [
    "LOGGERS",
    "RUN_FILES",
    "RunLog",
    "add_run_arguments",
    "check_loggers",
    "check_run_dir",
    "eta",
    "format_duration",
    "model_line",
    "settings_from",
]

# What zeropipe train writes in --out: what --overwrite removes, and nothing else.
RUN_FILES = (
    "metrics.jsonl",
    "checkpoints",
    "timeline.png",
    "loss.png",
    "trace.json",
    "tensorboard",
    "wandb",
)
# A folder holding one of these holds a run: it is continued or replaced, never mixed into.
_RUN_MARKS = ("metrics.jsonl", "checkpoints")

# --log's sinks: name -> (module that must import, the pip line that installs it).
LOGGERS: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "tensorboard": ("torch.utils.tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
}


def check_run_dir(out: str | Path, resume: bool, overwrite: bool) -> None:
    """Refuse (one line) a ``--out`` that holds a run, unless it is resumed or overwritten;
    with ``overwrite``, remove the run's own files (:data:`RUN_FILES`) and nothing else."""
    if resume and overwrite:
        raise ZeropipeError(
            "--resume continues the run in --out and --overwrite replaces it; pass one of them"
        )
    path = Path(out)
    found = [name for name in _RUN_MARKS if (path / name).exists()]
    if not found or resume:
        return
    if not overwrite:
        held = " and ".join(f + ("/" if (path / f).is_dir() else "") for f in found)
        raise ZeropipeError(
            f"--out {out} already holds a run ({held}); pass --resume to continue it or "
            f"--overwrite to replace it, or give another --out"
        )
    for name in RUN_FILES:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()


def check_loggers(spec: str) -> list[str]:
    """``--log``'s comma list, each sink known and its package importable (one-line errors)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise ZeropipeError(f"--log takes a comma list of {', '.join(LOGGERS)}, got {spec!r}")
    for name in names:
        if name not in LOGGERS:
            raise ZeropipeError(
                f"--log: unknown sink {name!r}; choose from {', '.join(LOGGERS)} (comma list)"
            )
        needs = LOGGERS[name]
        if needs is None:
            continue
        module, pip = needs
        try:
            importlib.import_module(module)
        except ImportError:
            raise ZeropipeError(
                f"--log {name} needs the {name} package, which is not installed: "
                f"{pip} (or pip install 'zeropipe[{name}]')"
            ) from None
    return list(dict.fromkeys(names))


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} bytes"


def model_line(params: int, nbytes: int, seq: int, vocab: int) -> str:
    """E.g. 'model: 1.23M parameters (4.7 MiB), sequence length 48, vocabulary 40'."""
    return (
        f"model: {_count(params)} parameters ({_bytes(nbytes)}), sequence length {seq}, "
        f"vocabulary {vocab}"
    )


def format_duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m' (rounded to whole seconds or minutes)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta(step_times: Sequence[float], remaining: int) -> str:
    """'ETA 1m05s': the remaining steps at the median step time so far (a checkpoint's slow
    step does not move it); '' before the first step or after the last."""
    if not step_times or remaining <= 0:
        return ""
    return f"ETA {format_duration(remaining * statistics.median(step_times))}"


class RunLog:
    """Where rank 0 writes each step's metrics: the sinks ``--log`` named.

    TensorBoard's writer purges the steps after ``start`` (``purge_step``): a resumed
    run's redone steps replace the ones the stopped run logged after its checkpoint.
    """

    def __init__(
        self, out: Path, sinks: Sequence[str], start: int, settings: Mapping[str, Any]
    ) -> None:
        self._jsonl = out / "metrics.jsonl" if "jsonl" in sinks else None
        self._tb: Any = None
        self._wandb: Any = None
        if "tensorboard" in sinks:
            from torch.utils.tensorboard import SummaryWriter

            # Resumed after step ``start``: the stopped run's later steps are redone.
            purge = start + 1 if start else None
            # Flushed every few seconds (torch's default is two minutes): a run that crashes
            # keeps its curve up to then.
            self._tb = SummaryWriter(
                log_dir=str(out / "tensorboard"), purge_step=purge, flush_secs=5
            )
        if "wandb" in sinks:
            os.environ["WANDB_MODE"] = "offline"  # nothing leaves the machine
            wandb = importlib.import_module("wandb")
            (out / "wandb").mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project="zeropipe", dir=str(out), mode="offline", config=dict(settings)
            )

    def step(self, record: Mapping[str, Any]) -> None:
        """One step's metrics (``record["step"]`` is the step)."""
        if self._jsonl is not None:
            with open(self._jsonl, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        scalars = {
            f"train/{k}": float(v)
            for k, v in record.items()
            if k not in ("step", "eval_loss")
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        }
        if "eval_loss" in record:  # --eval-every: the held-out loss, with the final one
            scalars["eval/loss"] = float(record["eval_loss"])
        self._scalars(scalars, int(record["step"]))

    def eval(self, step: int, loss: float) -> None:
        """The eval loss after ``step`` steps."""
        self._scalars({"eval/loss": loss}, step)

    def _scalars(self, values: Mapping[str, float], step: int) -> None:
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, step)
        if self._wandb is not None:
            self._wandb.log(dict(values), step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


# -- --config FILE.toml ----------------------------------------------------------------


class _Default:
    """A flag's default, marked: a value the command line did not give."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _flags(config_type: type) -> dict[str, str]:
    """The settings a flag sets: field name -> its annotation."""
    return {f.name: str(f.type) for f in dataclasses.fields(config_type) if f.name not in NOT_FLAGS}


def add_run_arguments(parser: Any, config_type: type) -> None:
    """--overwrite, --log and --config; then the default of every flag of ``config_type``'s
    fields is marked (call it after the other flags are added)."""
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run in --out (its metrics.jsonl, checkpoints/, pictures, trace, "
        "tensorboard/ and wandb/; nothing else) instead of refusing it",
    )
    parser.add_argument(
        "--log",
        default="jsonl",
        metavar="SINKS",
        help="where step metrics go, a comma list of jsonl (metrics.jsonl), tensorboard "
        "(<out>/tensorboard; pip install 'zeropipe[tensorboard]') and wandb (offline, "
        "<out>/wandb; pip install 'zeropipe[wandb]') (default jsonl)",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="settings as in the flags (keys: flag names without the leading --, e.g. steps = 300, "
        "batch-size = 16 or batch_size = 16); flags given on the command line override the file",
    )
    parser.set_defaults(
        **{name: _Default(parser.get_default(name)) for name in _flags(config_type)}
    )


def settings_from(args: argparse.Namespace, config_type: type) -> dict[str, Any]:
    """The fields of ``config_type`` that the flags given or ``--config``'s file set, the
    flags winning; the rest are left out (their defaults are the dataclass's)."""
    fields = _flags(config_type)
    given: dict[str, Any] = {}
    for name in fields:
        value = getattr(args, name, None)
        # Left out: the file's value or TrainConfig's default; a flag given never parses to None.
        if value is not None and not isinstance(value, _Default):
            given[name] = value
    path = getattr(args, "config", None)
    path = path.value if isinstance(path, _Default) else path
    from_file = _read_config(path, fields) if path is not None else {}
    return {**from_file, **given}


def _toml() -> Any:
    """tomllib (Python >= 3.11), or the tomli it grew from."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        return importlib.import_module("tomli")
    except ImportError:
        raise ZeropipeError(
            "--config needs Python >= 3.11 (tomllib) or the tomli package: pip install tomli"
        ) from None


def _read_config(path: str, fields: Mapping[str, str]) -> dict[str, Any]:
    toml = _toml()
    try:
        with open(path, "rb") as fh:
            table = toml.load(fh)
    except OSError as exc:
        raise ZeropipeError(f"--config {path} cannot be read ({exc.strerror or exc})") from None
    except toml.TOMLDecodeError as exc:
        raise ZeropipeError(f"--config {path} is not valid TOML ({exc})") from None
    settings: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in fields:
            near = difflib.get_close_matches(name, list(fields), n=1, cutoff=0.5)
            hint = (
                f"did you mean {near[0]} (--{near[0].replace('_', '-')})?"
                if near
                else "see 'zeropipe train --help' for the flags"
            )
            raise ZeropipeError(f"--config {path}: unknown key {key!r}; {hint}")
        settings[name] = _typed(path, key, value, fields[name])
    return settings


def _typed(path: str, key: str, value: Any, annotation: str) -> Any:
    """``value`` if it is of the field's type (an int is a float too), else a one-line error."""
    kinds = {k.strip() for k in str(annotation).split("|")}
    ok = (
        ("bool" in kinds and isinstance(value, bool))
        or ("int" in kinds and isinstance(value, int) and not isinstance(value, bool))
        or ("float" in kinds and isinstance(value, (int, float)) and not isinstance(value, bool))
        or ("str" in kinds and isinstance(value, str))
    )
    if not ok:
        words = {
            "bool": "true or false",
            "int": "an integer",
            "float": "a number",
            "str": "a string",
        }
        want = " or ".join(words[k] for k in sorted(kinds) if k in words)
        raise ZeropipeError(
            f"--config {path}: {key} = {value!r} is not {want} (as --{key.replace('_', '-')} takes)"
        )
    return float(value) if kinds & {"float"} and not kinds & {"int"} else value
