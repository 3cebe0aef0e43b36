"""zeropipe train --profile: rank 0's torch profiler trace of the traced step, every action of
the schedule named in it (PP:0F1, ...), in --out's torch_trace.json, which --overwrite removes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from zeropipe.apps.cli import build_parser
from zeropipe.apps.train import log
from zeropipe.apps.train.config import TrainConfig
from zeropipe.apps.train.loop import train

SMALL: dict[str, Any] = {
    "width": 32,
    "blocks": 2,
    "seq": 16,
    "batch_size": 8,
    "microbatches": 4,
    "quiet": True,
}


def test_profile_writes_the_traced_steps_torch_trace(tmp_path: Path) -> None:
    cfg = TrainConfig(**SMALL, ranks=1, schedule="1f1b", steps=2, out=str(tmp_path), profile=True)
    summary = train(cfg)
    assert summary["trace_step"] == 1  # trace_step 10, clamped to the run's last step
    trace = json.loads((tmp_path / "torch_trace.json").read_text())
    names = Counter(
        e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("PP:")
    )
    # One step's worth: each action of the schedule once (not twice: one step profiled).
    assert names == Counter(f"PP:{a}" for acts in cfg.build_schedule().actions for a in acts)
    assert names["PP:0F3"] == names["PP:0B0"] == 1
    assert any(str(e.get("name", "")).startswith("Optimizer.step") for e in trace["traceEvents"])


def test_no_profile_no_torch_trace_and_overwrite_removes_it(tmp_path: Path) -> None:
    train(TrainConfig(**SMALL, ranks=1, schedule="1f1b", steps=1, out=str(tmp_path)))
    assert (tmp_path / "trace.json").is_file()
    assert not (tmp_path / "torch_trace.json").exists()
    (tmp_path / "torch_trace.json").write_text("{}")  # as an earlier --profile run left it
    log.check_run_dir(tmp_path, resume=False, overwrite=True)
    assert not (tmp_path / "torch_trace.json").exists()


def test_profile_is_a_flag() -> None:
    args = build_parser(["train"]).parse_args(["train", "--profile"])
    assert log.settings_from(args, TrainConfig) == {"profile": True}
    args = build_parser(["train"]).parse_args(["train"])
    assert "profile" not in log.settings_from(args, TrainConfig)
