"""What ``zeropipe plan`` shows and writes: the ranking as an aligned table, its footer,
and its JSON form (and the candidates read back from it)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from zeropipe.core.errors import ZeropipeError
from zeropipe.planning.cluster import Candidate, GiB, Ranking

__all__ = ["candidates_from_json", "footer", "format_table", "to_json"]


def _num(value: float, fmt: str) -> str:
    return "-" if math.isnan(value) else format(value, fmt)


def format_table(candidates: Sequence[Candidate], *, unit: str, cluster: bool = True) -> str:
    """The ranking as an aligned text table, with an ep or cp column only where a candidate
    uses it; ``cluster=False`` drops dp, tp, ep, cp, mbs and the throughput columns a
    measured single pipeline does not know."""
    memory_title = "peak GiB" if unit == "bytes" else f"peak ({unit})"
    titles = ["#", "pp", "dp", "tp", "ep", "cp", "mbs", "m", "chunks", "schedule", "memory plan"]
    titles += ["step s"]
    titles += ["tokens/s", "MFU", "bubble", memory_title, "fits"]
    rows = []
    for n, c in enumerate(candidates, 1):
        peak = c.peak_memory / GiB if unit == "bytes" else c.peak_memory
        row = [str(n), str(c.pp), str(c.dp), str(c.tp), str(c.ep), str(c.cp)]
        row += [str(c.microbatch_size)]
        row += [str(c.microbatches)]
        row += [str(c.chunks), c.schedule, c.memory_plan, f"{c.step_time:.4g}"]
        row += [_num(c.tokens_per_second, ",.0f"), _num(100 * c.mfu, ".1f") + "%"]
        row += [f"{c.bubble:.1%}", f"{peak:.3g}" if unit == "bytes" else f"{peak:.4g}"]
        row += ["yes" if c.fits else "NO"]
        rows.append(row)
    drop = {
        i for i, name in ((4, "ep"), (5, "cp")) if all(getattr(c, name) == 1 for c in candidates)
    }
    if not cluster:
        measured = {2, 3, 4, 5, 6}
        drop |= measured | {12, 13} if all(math.isnan(c.mfu) for c in candidates) else measured
    keep = [i for i in range(len(titles)) if i not in drop]
    table = [[titles[i] for i in keep]] + [[r[i].replace("-%", "-") for i in keep] for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(keep))]
    left = {keep.index(i) for i in (9, 10) if i in keep}  # text columns
    lines = []
    for r in table:
        pairs = enumerate(zip(r, widths, strict=True))
        cells = [v.ljust(w) if i in left else v.rjust(w) for i, (v, w) in pairs]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def footer(ranking: Ranking) -> str:
    return (
        f"{ranking.priced} of {ranking.considered} configurations simulated, "
        f"{ranking.pruned} pruned (a lower bound on their step time, or not fitting, kept "
        f"them out of the top), {ranking.refused} refused by a schedule or the cost model; "
        f"{ranking.seconds:.1f} s"
    )


def to_json(ranking: Ranking, header: Sequence[str]) -> dict[str, Any]:
    """The ranking as a JSON object; :func:`candidates_from_json` reads its candidates."""
    return {
        "format": "zeropipe-plan",
        "version": 1,
        "header": list(header),
        "considered": ranking.considered,
        "priced": ranking.priced,
        "pruned": ranking.pruned,
        "refused": ranking.refused,
        "seconds": ranking.seconds,
        "notes": list(ranking.notes),
        "candidates": [_finite(c.to_dict()) for c in ranking.candidates],
    }


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN: an unknown figure is null.
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def candidates_from_json(data: dict[str, Any]) -> list[Candidate]:
    if data.get("format") != "zeropipe-plan":
        raise ZeropipeError("not a zeropipe plan: field 'format' must be 'zeropipe-plan'")
    return [
        Candidate.from_dict({k: math.nan if v is None else v for k, v in row.items()})
        for row in data.get("candidates", [])
    ]
