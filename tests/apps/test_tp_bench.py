"""benchmarks/tensor_parallel.py: a tiny pp 2 x tp 2 run of both libraries, exact and consistent.

One launch of four gloo processes (``--quick``: tiny models, 2 reps), called in-process
through the script's ``main``; the processes it spawns import ``benchmarks.tensor_parallel``
again, from the checkout this test runs in.  Every model-schedule pair runs, the MLP's
zero-bubble ones included: zeropipe must run and be exact on all of them; torch's schedules
may fail (on torch 2.13 its zero-bubble ones do on the MLP), and a row says so consistently.
"""

from __future__ import annotations

import importlib

import pytest

tp_bench = importlib.import_module("benchmarks.tensor_parallel")


def test_quick_run_is_exact_and_its_rows_are_consistent(capsys: pytest.CaptureFixture[str]) -> None:
    status, rows = tp_bench.main(["--quick"])
    out = capsys.readouterr().out
    assert status == 0, out
    cfg = tp_bench.QUICK
    expected = tp_bench.pairs(cfg)
    assert [(r["model"], r["schedule"]) for r in rows] == expected
    # Every pair runs: both models under all four schedules, the MLP's zbv included.
    assert {("mlp", "zbv"), ("mlp", "1f1b"), ("transformer", "interleaved-zb")} <= set(expected)
    assert len(expected) == len(tp_bench.MODELS) * len(tp_bench.DEFAULT_SCHEDULES)
    assert not tp_bench.problems(rows)
    for r in rows:
        assert (r["pp"], r["tp"], r["reps"]) == (2, 2, cfg.reps)
        assert min(r["cut"]) >= 1
        # zeropipe: never fails, exact, timed.
        assert r["zeropipe_failure"] is None, r
        assert r["zeropipe_exact"] is True and r["zeropipe_error"] <= tp_bench.TOLERANCE, r
        assert r["zeropipe_step_s"] > 0
        failure = r["torch_failure"]
        if failure is None:  # torch ran: exact, timed, and the ratio is the two medians'
            assert r["torch_exact"] is True and r["torch_error"] <= tp_bench.TOLERANCE, r
            assert r["torch_step_s"] > 0
            assert r["ratio"] == pytest.approx(r["zeropipe_step_s"] / r["torch_step_s"])
        else:  # torch failed: no time, no ratio, and the table names the reason
            assert isinstance(failure, str) and failure.strip(), r
            assert r["torch_step_s"] is None and r["ratio"] is None, r
            if "exactness step" in failure:
                assert r["torch_exact"] is None and r["torch_error"] is None, r
            else:  # it failed later, while timing: then it was exact first
                assert r["torch_exact"] is True, r
            note = " ".join(out.split())  # the note is wrapped over lines
            assert f"torch fails on {r['schedule']}: {' '.join(failure.split())}" in note
    # The table: a line per pair, "fails" and "n/a" exactly where torch failed, a note each.
    table = [c for c in map(str.split, out.splitlines()) if c and c[0] in cfg.schedules]
    assert [c[0] for c in table] == [r["schedule"] for r in rows]
    for cells, r in zip(table, rows, strict=True):
        zp, th, ratio, zp_exact, th_exact = cells[1:6]
        assert float(zp) > 0 and zp_exact == "yes", cells
        if r["torch_failure"]:
            assert (th, ratio) == ("fails", "n/a"), cells
        else:
            assert float(th) > 0 and float(ratio) > 0 and th_exact == "yes", cells
    assert out.count("torch fails on ") == sum(bool(r["torch_failure"]) for r in rows)
    assert "zeropipe fails" not in out
