"""What the benchmarks that hold the planner against a published table share: the summary
line (how many rows' ``ratio`` is within a bar of 1, and the worst) and the closing output
(the table and the summary on stdout, the seconds taken on stderr, the rows as JSON when
asked).  ``megatron_table``, ``moe_table`` and ``long_context_table`` import it as a sibling
module: run as scripts, their folder is on ``sys.path`` (their tests put it there).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any


def within_summary(rows: Sequence[dict[str, Any]], bar: float, where: str) -> str:
    """``rows within 15% <where>: 7/10; worst +18.2% (<row>)``: the rows whose ``ratio`` is
    within ``bar`` of 1, and the one farthest from it."""
    worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
    within = sum(abs(r["ratio"] - 1) <= bar for r in rows)
    return (
        f"rows within {bar:.0%} {where}: {within}/{len(rows)}; worst "
        f"{worst['ratio'] - 1:+.1%} ({worst['row']})"
    )


def finish(
    rows: list[dict[str, Any]],
    lines: Sequence[str],
    *,
    source: str,
    hardware: str,
    json_path: str | None,
    started: float,
) -> None:
    """Print ``lines`` (the table, the summary), the seconds since ``started`` on stderr, and
    write ``rows`` with their source and hardware to ``json_path`` when given."""
    for line in lines:
        print(line)
    print(f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"source": source, "hardware": hardware, "rows": rows}, f, indent=1)
