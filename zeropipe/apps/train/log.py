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
    add_config_argument(parser, cls)       --config, and the default of every flag of cls marked
    settings_from(args, cls)               the flags given, over a --config FILE.toml

A flag given on the command line overrides the file: :func:`add_config_argument`
marks every default, so :func:`settings_from` can tell a flag left out from one
given with its default value.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import os
import re
import shutil
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from zeropipe.apps.cli_args import flag_fields
from zeropipe.apps.export_target import checkpoint_home
from zeropipe.core.errors import ZeropipeError

__all__ = [
    "LOGGERS",
    "RUN_FILES",
    "RUN_FOLDERS",
    "RunLog",
    "add_config_argument",
    "check_loggers",
    "check_run_dir",
    "eta",
    "format_duration",
    "model_line",
    "settings_from",
]

# What zeropipe train writes in --out.  --overwrite removes these files, and in these
# folders only the entries whose names zeropipe's writers give them (the folder itself
# only once nothing else is left in it): never anything of the user's.
RUN_FILES = ("metrics.jsonl", "timeline.png", "loss.png", "trace.json", "torch_trace.json")
RUN_FOLDERS: dict[str, tuple[str, ...]] = {
    "checkpoints": (
        r"latest",
        r"step-\d{6,}",
        r"\.step-\d{6,}\.(partial|old)",
        r"\.latest\.tmp-\d+",
    ),
    "tensorboard": (r"events\.out\.tfevents\..*",),
    "wandb": (r"offline-run-.*", r"run-.*", r"latest-run", r"debug.*\.log"),
}


# --log's sinks: name -> (module that must import, the pip line that installs it).
LOGGERS: dict[str, tuple[str, str] | None] = {
    "jsonl": None,
    "tensorboard": ("torch.utils.tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", "pip install wandb"),
}


def _ours(folder: str, name: str) -> bool:
    return any(re.fullmatch(pattern, name) for pattern in RUN_FOLDERS[folder])


def _run_marks(path: Path) -> list[str]:
    """What in ``path`` says a zeropipe run is there: its metrics, or a checkpoints folder of
    zeropipe's (``latest``, or a ``step-NNNNNN`` folder)."""
    found = ["metrics.jsonl"] if (path / "metrics.jsonl").exists() else []
    ckpts = path / "checkpoints"
    if ckpts.is_dir() and any(_ours("checkpoints", p.name) for p in ckpts.iterdir()):
        found.append("checkpoints/")
    return found


def _refuse_foreign_places(out: str | Path, path: Path) -> None:
    """An --out in a checkpoint or checkpoints folder (its run would delete it with its own
    pruning, or mix into it), or whose checkpoints/ is another program's."""
    home = checkpoint_home(path)
    if home is not None:
        raise ZeropipeError(
            f"--out {out} is {'' if home == path.absolute().resolve() else 'inside '}{home}, a "
            f"zeropipe checkpoint folder; give an --out outside it"
        )
    ckpts = path / "checkpoints"
    if ckpts.exists() and not ckpts.is_dir():
        raise ZeropipeError(f"--out {out} has a file named checkpoints; give another --out")
    foreign = sorted(p.name for p in ckpts.iterdir()) if ckpts.is_dir() else []
    if foreign and not any(_ours("checkpoints", name) for name in foreign):
        raise ZeropipeError(
            f"--out {out} has a checkpoints/ folder that is not zeropipe's (it holds "
            f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); give another --out"
        )


def check_run_dir(out: str | Path, resume: bool, overwrite: bool) -> None:
    """Refuse (one line) a ``--out`` that holds a run, unless it is resumed or overwritten;
    with ``overwrite``, remove the run's own files (see :data:`RUN_FOLDERS`) and nothing
    else.  An ``--out`` in a checkpoint folder, or whose checkpoints/ is not zeropipe's, is
    refused whatever the flags."""
    if resume and overwrite:
        raise ZeropipeError(
            "--resume continues the run in --out and --overwrite replaces it; pass one of them"
        )
    path = Path(out)
    _refuse_foreign_places(out, path)
    found = _run_marks(path)
    if not found or resume:
        return
    if not overwrite:
        raise ZeropipeError(
            f"--out {out} already holds a run ({' and '.join(found)}); pass --resume to "
            f"continue it or --overwrite to replace it, or give another --out"
        )
    for name in RUN_FILES:
        if (path / name).is_file() or (path / name).is_symlink():
            (path / name).unlink()
    for folder in RUN_FOLDERS:
        here = path / folder
        if not here.is_dir() or here.is_symlink():
            continue
        for entry in here.iterdir():
            if not _ours(folder, entry.name):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        with contextlib.suppress(OSError):  # kept where something of the user's is left
            here.rmdir()


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
    return {f.name: str(f.type) for f in flag_fields(config_type)}


def add_config_argument(parser: Any, config_type: type) -> None:
    """--config; then the default of every flag of ``config_type``'s fields is marked (call
    it after the other flags are added)."""
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
