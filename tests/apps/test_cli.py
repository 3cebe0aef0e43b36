"""The ``zeropipe`` command line: listing, simulating, files, and one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zeropipe.apps import cli
from zeropipe.core.costs import CostModel
from zeropipe.core.schedules import GENERATORS, generate
from zeropipe.core.simulate import simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    code, out, err = run(capsys, "simulate", "--json", *argv)
    assert (code, err) == (0, "")
    assert len(out.strip().splitlines()) == 1  # one JSON object, nothing else
    result: dict[str, object] = json.loads(out)
    return result


def test_schedules_lists_every_generator(capsys) -> None:
    code, out, _ = run(capsys, "schedules")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(GENERATORS)
    names = [line.split()[0] for line in lines]
    assert {"gpipe", "1f1b"} <= set(names)
    line = lines[names.index("gpipe")]
    assert "chunks: 1 per rank" in line and GENERATORS["gpipe"].description in line


def test_simulate_json_matches_the_simulator(capsys) -> None:
    got = run_json(
        capsys,
        *("--schedule", "1f1b", "--ranks", "4", "--microbatches", "6", "--costs", "F=1,B=3"),
    )
    want = simulate(generate("1f1b", 4, 6), CostModel.parse("F=1,B=3", 4))
    assert got["makespan"] == want.makespan == 3 * 4 + 6 * 4  # (p - 1)(F + B) + m(F + B)
    assert got["bubble_rate"] == pytest.approx(want.bubble_rate)
    assert got["steady_bubble_rate"] == pytest.approx(want.steady_bubble_rate)
    assert got["peak_memory"] == [4.0, 3.0, 2.0, 1.0]
    assert (got["schedule"], got["ranks"], got["stages"], got["microbatches"]) == ("1f1b", 4, 4, 6)
    assert got["memory_unit"] == "microbatch"


def test_simulate_defaults(capsys) -> None:
    got = run_json(capsys)
    assert got["schedule"] == ("zbv" if "zbv" in GENERATORS else "1f1b")
    assert (got["ranks"], got["microbatches"]) == (4, 8)


def test_simulate_prints_grid_summary_and_schedule_text(capsys) -> None:
    argv = ("simulate", "--schedule", "gpipe", "--ranks", "3", "--microbatches", "2")
    code, out, err = run(capsys, *argv, "--width", "40", "--show")
    assert (code, err) == (0, "")
    assert out.startswith("# zeropipe schedule\nname: gpipe\n")
    assert "rank 2: 2F0 2F1 2B0 2B1" in out
    grid_rows = [line for line in out.splitlines() if line.startswith("rank ") and "|" not in line]
    assert len(grid_rows) == 3 + 3  # three in the schedule text, three in the grid
    assert "makespan 12  bubble rate 50.0%" in out
    assert "peak memory per rank (unit: microbatch): 2, 2, 2" in out


def test_simulate_lower_adds_sends_and_receives(capsys) -> None:
    got = run_json(capsys, "--schedule", "1f1b", "--ranks", "2", "--lower", "--show")
    assert got["lowered"] is True
    assert "0SEND_F0" in str(got["text"]) and "1RECV_F0" in str(got["text"])


def test_simulate_text_file(tmp_path: Path, capsys) -> None:
    schedule = generate("gpipe", 2, 3)
    path = tmp_path / "mine.txt"
    path.write_text(schedule.to_text())
    got = run_json(capsys, "--schedule", str(path), "--costs", "F=2,B=1")
    assert (got["schedule"], got["ranks"], got["microbatches"]) == ("gpipe", 2, 3)
    assert got["makespan"] == simulate(schedule, CostModel.parse("F=2,B=1", 2)).makespan


def test_simulate_torch_csv_file(tmp_path: Path, capsys) -> None:
    schedule = generate("1f1b", 3, 4)
    path = tmp_path / "torch_1f1b.csv"
    path.write_text(schedule.to_torch_csv())
    got = run_json(capsys, "--schedule", str(path))
    assert (got["schedule"], got["ranks"], got["stages"], got["microbatches"]) == (
        "torch_1f1b",
        3,
        3,
        4,
    )
    assert got["makespan"] == simulate(schedule, CostModel.parse("", 3)).makespan


def test_simulate_json_file(tmp_path: Path, capsys) -> None:
    schedule = generate("1f1b", 2, 5)
    path = tmp_path / "s.json"
    path.write_text(schedule.to_json())
    got = run_json(capsys, "--schedule", str(path), "--ranks", "2")
    assert got["makespan"] == simulate(schedule, CostModel.parse("", 2)).makespan


def test_simulate_cost_file(tmp_path: Path, capsys) -> None:
    costs = CostModel.parse("F=1,B=2", 2).replace_stage(1, F=5.0)
    path = tmp_path / "costs.json"
    path.write_text(costs.to_json())
    got = run_json(capsys, "--schedule", "gpipe", "--ranks", "2", "--costs", str(path))
    assert got["makespan"] == simulate(generate("gpipe", 2, 8), costs).makespan


def test_simulate_memory_limit_that_fits(capsys) -> None:
    got = run_json(capsys, "--schedule", "1f1b", "--memory-limit", "4")
    peaks = got["peak_memory"]
    assert got["memory_limit"] == 4.0 and isinstance(peaks, list) and max(peaks) == 4.0


def test_simulate_writes_plot_and_trace(tmp_path: Path, capsys) -> None:
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    argv = ("--schedule", "1f1b", "--ranks", "2", "--microbatches", "2")
    got = run_json(capsys, *argv, "--plot", str(png), "--trace", str(trace))
    assert got["files"] == {"plot": str(png), "trace": str(trace)}
    assert png.read_bytes().startswith(PNG_MAGIC)
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 * 2 * 2


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["simulate", "--schedule", "nope"], ["unknown schedule 'nope'", "gpipe"]),
        (["simulate", "--schedule", "missing.json"], ["missing.json does not exist"]),
        (["simulate", "--costs", "F=1,Q=2"], ["'Q=2'"]),
        (["simulate", "--costs", "F=fast"], ["cost F is not a number"]),
        (["simulate", "--costs", "F=-1"], ["F = -1.0 must be finite and >= 0"]),
        (["simulate", "--costs", "comm=-5"], ["comm = -5.0 must be finite and >= 0"]),
        (["simulate", "--costs", "F=nan"], ["F = nan must be finite"]),
        (["simulate", "--costs", "F=inf"], ["F = inf must be finite"]),
        (["simulate", "--schedule", "auto", "--costs", "F=-1"], ["F = -1.0 must be"]),
        (
            ["simulate", "--schedule", "1f1b", "--memory-limit", "2"],
            ["rank 0 holds 4", "limit of 2"],
        ),
        (["simulate", "--memory-limit", "-1"], ["--memory-limit", "must be > 0"]),
        (["simulate", "--ranks", "two"], ["--ranks", "'two'"]),
        (["simulate", "--schedule", "1f1b", "--chunks", "2"], ["1f1b uses 1 chunk"]),
        (["simulate", "--bogus"], ["unrecognized arguments: --bogus"]),
        # Flags these commands lack (profile has --stages): unknown, never taken as a prefix
        (["simulate", "--stages", "4"], ["unrecognized arguments: --stages 4"]),
        (["simulate", "--stage", "4"], ["unrecognized arguments: --stage 4"]),
        (["profile", "--layers", "4"], ["unrecognized arguments: --layers 4"]),
        (["train", "--layers", "4"], ["unrecognized arguments: --layers 4"]),
        (["frobnicate"], ["invalid choice: 'frobnicate'"]),
        ([], ["choose a command"]),
    ],
)
def test_user_errors_end_in_one_line_and_exit_2(capsys, argv: list[str], names: list[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    first = err.splitlines()[0]
    assert first.startswith("zeropipe: error: ")
    for name in names:
        assert name in first
    assert sum(line.startswith("zeropipe: error:") for line in err.splitlines()) == 1
    assert "Traceback" not in err


@pytest.mark.parametrize("ranks", [2, 4])
def test_simulate_ranks_is_the_number_of_ranks_its_header_says(capsys, ranks: int) -> None:
    code, out, _ = run(capsys, "simulate", "--schedule", "zbv", "--ranks", str(ranks))
    assert code == 0
    # zbv holds two chunks per rank: twice as many stages as ranks.
    assert out.splitlines()[0].startswith(f"zbv: {ranks} ranks, {2 * ranks} stages, ")


def test_memory_error_shows_the_grid_after_the_line(capsys) -> None:
    code, _, err = run(capsys, "simulate", "--schedule", "1f1b", "--memory-limit", "3")
    lines = err.splitlines()
    assert code == 2 and len(lines) > 2
    assert lines[1].startswith("step") and ">0F3<" in err


@pytest.mark.parametrize(
    ("content", "suffix", "names"),
    [
        ("garbage\n", ".txt", ["bad.txt", "line 1"]),
        ('{"format": ', ".json", ["cannot read schedule file", "bad.json"]),
        ("[1, 2]", ".json", ["expected a JSON object"]),
        ("0F0,0B0\n1F0,(1B0;1F1)\n", ".csv", ["a pair is a forward F then a backward B or I"]),
        ("0F0,0F1\n1F0,1B0\n", ".csv", ["has no backward: add 0B0"]),
        (
            '{"format": "zeropipe-schedule", "microbatches": "two", "placement": [0],'
            ' "actions": [["0F0", "0B0"]]}',
            ".json",
            ["bad.json", "microbatches must be an integer, got 'two'"],
        ),
        (
            '{"format": "zeropipe-schedule", "microbatches": 1, "placement": [0],'
            ' "actions": [["0F0", "1B0"]]}',
            ".json",
            ["action 1B0 on rank 0: stage 1 is not in the placement (stages 0-0)"],
        ),
        (
            '{"format": "zeropipe-schedule", "placement": [0], "actions": [["0F0"]]}',
            ".json",
            ["lacks field 'microbatches'"],
        ),
        ("0F0,0B0\n1F0,3F0,1B0\n", ".csv", ["action 3F0 on rank 1", "stage(s) [2]"]),
        (
            "microbatches: 1\nplacement: 0 1\nrank 0: 0F0 0B0\nrank 1: 1F0 3F0 1B0\n",
            ".txt",
            ["action 3F0 on rank 1: stage 3 is not in the placement (stages 0-1)"],
        ),
        ("microbatches: two\nplacement: 0\nrank 0: 0F0 0B0\n", ".txt", ["'two'"]),
    ],
)
def test_bad_schedule_files(tmp_path: Path, capsys, content: str, suffix: str, names) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(content)
    code, _, err = run(capsys, "simulate", "--schedule", str(path))
    assert code == 2 and err.startswith("zeropipe: error: ")
    for name in names:
        assert name in err.splitlines()[0]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("F", -1, "stage 2: F = -1 must be finite and >= 0"),
        ("W_fused", -0.5, "stage 2: W_fused = -0.5 must be"),
        ("boundary_bytes", "big", "stage 2: boundary_bytes = 'big' is not a number"),
    ],
)
def test_bad_cost_file_ends_in_one_line(tmp_path: Path, capsys, field, value, message) -> None:
    data = CostModel.uniform(4).to_dict()
    data["stages"][2][field] = value
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(data))
    code, out, err = run(capsys, "simulate", "--schedule", "1f1b", "--costs", str(path))
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith(f"zeropipe: error: cost file {path}: {message}")


def test_file_contradicting_a_flag(tmp_path: Path, capsys) -> None:
    path = tmp_path / "s.txt"
    path.write_text(generate("gpipe", 2, 3).to_text())
    code, _, err = run(capsys, "simulate", "--schedule", str(path), "--ranks", "4")
    assert code == 2
    assert "has 2 rank(s) but --ranks 4 was given" in err


def test_unwritable_output_is_a_user_error(tmp_path: Path, capsys) -> None:
    target = tmp_path / "no" / "such" / "dir" / "t.json"
    code, _, err = run(capsys, "simulate", "--trace", str(target))
    assert code == 2 and err.startswith("zeropipe: error: ") and str(target) in err


def test_help_exits_zero(capsys) -> None:
    code, out, _ = run(capsys, "simulate", "--help")
    assert code == 0
    assert "p*v stages" in out.replace("\n", " ").replace("  ", " ")


def test_a_new_command_is_one_table_entry(monkeypatch, capsys) -> None:
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--n", type=int, default=1)

    def run_hello(args: argparse.Namespace) -> int:
        """Say hello."""
        print("hello " * args.n)
        return 3

    monkeypatch.setitem(cli.COMMANDS, "hello", (add_arguments, run_hello))
    assert run(capsys, "hello", "--n", "2") == (3, "hello hello \n", "")
    _, out, _ = run(capsys, "--help")
    assert "Say hello." in out


def test_python_dash_m_zeropipe_simulate_with_defaults() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "zeropipe", "simulate", "--width", "50"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "makespan" in proc.stdout and "rank 3" in proc.stdout
    assert proc.stderr == ""


def test_matplotlib_is_imported_only_to_draw() -> None:
    code = "import sys, zeropipe.apps.cli; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120, check=False).returncode == 0


def test_many_ranks_draw_a_capped_grid_and_peak_line(capsys) -> None:
    argv = ["simulate", "--schedule", "1f1b", "--ranks", "70", "--microbatches", "2"]
    code, out, _ = run(capsys, *argv, "--width", "40")
    assert code == 0
    assert sum(line.startswith("rank ") for line in out.splitlines()) == 64
    assert "... 6 more ranks not drawn; --json / --trace have them all" in out
    [peaks] = [line for line in out.splitlines() if line.startswith("peak memory")]
    assert peaks.count(",") == 64 and peaks.endswith("... 6 more (highest of all: 2)")
    assert len(run_json(capsys, *argv[1:])["peak_memory"]) == 70  # --json has every rank


def test_costs_too_large_to_add_up_end_in_one_line(capsys) -> None:
    code, out, err = run(capsys, "simulate", "--costs", "F=1e308", "--width", "40")
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith("zeropipe: error: the simulated times add up past the largest float")


def _two_stage_costs(tmp_path: Path) -> Path:
    path = tmp_path / "costs.json"  # as `zeropipe profile --stages 2 --out costs.json` writes
    path.write_text(CostModel.uniform(2).to_json())
    return path


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        # zbv holds two stages per rank: a 2-stage file fits one rank.
        (["--schedule", "zbv", "--ranks", "2"], "give --ranks 1 (zbv: 2 chunk(s) per rank)"),
        (["--ranks", "2"], "give --ranks 1 (zbv: 2 chunk(s) per rank)"),  # zbv is the default
        (["--schedule", "1f1b", "--ranks", "4"], "give --ranks 2 (1f1b: 1 chunk(s) per rank)"),
        (["--schedule", "interleaved-1f1b", "--ranks", "2", "--chunks", "3"], "give --chunks 1"),
    ],
)
def test_a_cost_file_of_other_stages_names_the_flags_that_fit(
    tmp_path: Path, capsys, argv: list[str], hint: str
) -> None:
    path = _two_stage_costs(tmp_path)
    code, out, err = run(capsys, "simulate", "--costs", str(path), *argv)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert line.startswith(f"zeropipe: error: cost file {path} has 2 stage(s) but ")
    assert hint in line, line
    assert "stages = ranks x chunks" in line and "zeropipe profile --stages" in line, line
    assert run(capsys, "simulate", "--costs", str(path), "--ranks", "1")[0] == 0  # the hint works


def test_a_schedule_file_against_a_cost_file_of_other_stages(tmp_path: Path, capsys) -> None:
    schedule = tmp_path / "s.txt"
    schedule.write_text(generate("1f1b", 4, 4).to_text())
    path = _two_stage_costs(tmp_path)
    code, _, err = run(capsys, "simulate", "--schedule", str(schedule), "--costs", str(path))
    assert code == 2
    assert f"{schedule} has 4" in err and "zeropipe profile --stages 4" in err, err


@pytest.mark.parametrize(
    ("argv", "size"),
    [
        (["--ranks", "100000", "--microbatches", "100000"], "6e+10 actions"),  # zbv: 2 chunks
        (["--schedule", "1f1b", "--ranks", "3000", "--microbatches", "3000"], "2.7e+07 actions"),
        (["--schedule", "auto", "--ranks", "512", "--microbatches", "512"], "1.6e+06 actions"),
    ],
)
def test_a_size_that_would_run_for_ages_is_refused_up_front(
    capsys, argv: list[str], size: str
) -> None:
    code, out, err = run(capsys, "simulate", *argv)
    assert code == 2 and out == ""
    [line] = err.splitlines()
    assert size in line and "would take ~" in line and "--force" in line, line


def test_the_size_limit_keeps_the_benchmarked_sizes(capsys) -> None:
    # benchmarks/schedule_speed.py's largest case, and auto's: within the limit, not run here.
    assert cli.simulate_actions("zbv", 128, 1024, None) <= cli.SIMULATE_LIMIT
    assert cli.simulate_actions("auto", 64, 256, None) <= cli.AUTO_LIMIT
    code, out, _ = run(capsys, "simulate", "--ranks", "16", "--microbatches", "32", "--width", "40")
    assert code == 0 and "makespan" in out


def test_force_runs_a_size_over_the_limit(monkeypatch, capsys) -> None:
    monkeypatch.setattr(cli, "SIMULATE_LIMIT", 10)
    argv = ["simulate", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4"]
    assert run(capsys, *argv)[0] == 2
    code, out, _ = run(capsys, *argv, "--force", "--width", "40")
    assert code == 0 and "makespan" in out


def test_version(capsys) -> None:
    from importlib.metadata import version

    code, out, _ = run(capsys, "--version")
    assert code == 0 and out == f"zeropipe {version('zeropipe')}\n"
