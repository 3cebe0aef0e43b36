"""The benchmarks that hold the planner against published tables, loaded as modules for the
tests (``benchmarks/`` is a folder of scripts, not a package): ``load("moe_table")``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``<name>_benchmark``, with the benchmarks'
    folder on ``sys.path`` as when it runs as a script (its sibling ``table_report``)."""
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec.loader.exec_module(module)
    return module
