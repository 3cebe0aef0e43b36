"""IR: canonical action text, schedule text/JSON/torch-CSV round-trips, grid rendering."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from tests.strategies import valid_schedules
from zeropipe.errors import ScheduleError
from zeropipe.ir import Action, Kind, Schedule, format_grid
from zeropipe.lower import lower


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("2F0", Action(Kind.F, 2, 0)),
        ("1SEND_B3", Action(Kind.SEND_B, 1, 3)),
        ("0W5", Action(Kind.W, 0, 5)),
        ("12RECV_F103", Action(Kind.RECV_F, 12, 103)),
        ("3R1", Action(Kind.R, 3, 1)),
        ("1RELOAD3", Action(Kind.RELOAD, 1, 3)),
        ("1OFFLOAD", Action(Kind.OFFLOAD, 1, None)),
    ],
)
def test_action_text_round_trips(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text


@pytest.mark.parametrize("bad", ["F0", "2X0", "2F", "-1F0", "2F0x", "", "2 F 0", "1SEND_B"])
def test_bad_action_text_is_a_schedule_error(bad: str) -> None:
    with pytest.raises(ScheduleError) as err:
        Action.parse(bad)
    assert err.value.rule == "syntax"


@given(valid_schedules())
@settings(max_examples=60, deadline=None)
def test_text_and_json_round_trip(schedule: Schedule) -> None:
    assert Schedule.from_text(schedule.to_text()) == schedule
    assert Schedule.from_json(schedule.to_json()) == schedule
    lowered = lower(schedule)
    assert Schedule.from_text(lowered.to_text()) == lowered


@given(valid_schedules())
@settings(max_examples=60, deadline=None)
def test_torch_csv_round_trip(schedule: Schedule) -> None:
    plain = schedule.replace_actions(
        [
            [a for a in acts if a.kind not in (Kind.R, Kind.OFFLOAD, Kind.RELOAD)]
            for acts in schedule.actions
        ]
    )
    for s in (plain, lower(plain)):
        back = Schedule.from_torch_csv(
            s.to_torch_csv(), microbatches=s.microbatches, placement=s.placement, name=s.name
        )
        assert back == s


def test_torch_csv_infers_placement_and_microbatches_and_skips_idle_cells() -> None:
    text = "0F0,0F1,,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    s = Schedule.from_torch_csv(text)
    assert s.placement == (0, 1)
    assert s.microbatches == 2
    assert [str(a) for a in s.actions[0]] == ["0F0", "0F1", "0B0", "0B1"]


def test_torch_csv_reads_a_file_written_by_torch(tmp_path: object) -> None:
    torch_sched = pytest.importorskip("torch.distributed.pipelining.schedules")
    order = {
        0: [torch_sched._Action.from_str(a) for a in ["0F0", "0F1", "0I0", "0W0", "0B1"]],
        1: [torch_sched._Action.from_str(a) for a in ["1F0", "1I0", "1F1", "1W0", "1B1"]],
    }
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf)
    for rank in order:  # what torch's _dump_csv does
        writer.writerow(order[rank])
    s = Schedule.from_torch_csv(buf.getvalue())
    assert [str(a) for a in s.actions[1]] == ["1F0", "1I0", "1F1", "1W0", "1B1"]
    back = list(csv.reader(io.StringIO(s.to_torch_csv())))
    assert [[str(torch_sched._Action.from_str(c)) for c in row] for row in back] == [
        [str(a) for a in order[0]],
        [str(a) for a in order[1]],
    ]


def test_torch_only_actions_are_rejected_by_name() -> None:
    with pytest.raises(ScheduleError, match="1UNSHARD"):
        Schedule.from_torch_csv("0F0,0B0\n1UNSHARD,1F0,1B0\n")


def test_export_of_recompute_to_torch_names_the_action() -> None:
    s = Schedule.from_text("microbatches: 1\nplacement: 0\nrank 0: 0F0 0R0 0B0\n")
    with pytest.raises(ScheduleError, match="0R0"):
        s.to_torch_csv()


def test_text_errors_name_the_line() -> None:
    with pytest.raises(ScheduleError, match="line 2"):
        Schedule.from_text("microbatches: 1\nbogus: 3\n")
    with pytest.raises(ScheduleError, match="placement"):
        Schedule.from_text("microbatches: 1\nrank 0: 0F0 0B0\n")
    with pytest.raises(ScheduleError, match="rank"):
        Schedule((0, 3), [[]], 1)


def test_format_grid_marks_cells_and_windows_long_schedules() -> None:
    acts = [[Action(Kind.F, 0, i) for i in range(40)]]
    grid = format_grid(acts, [(0, 30)], window=2)
    assert ">0F30<" in grid
    assert "0F27" not in grid and "0F28" in grid and "0F32" in grid
    assert "steps 28..32 of 0..39" in grid


def test_actions_survive_pickling_into_another_process() -> None:
    import subprocess
    import sys

    code = (
        "import pickle, sys\n"
        "from zeropipe.ir import Action, Kind\n"
        "got = pickle.loads(sys.stdin.buffer.read())\n"
        "table = {Action(Kind.F, 2, 0): 'f', Action(Kind.RELOAD, 1): 'w'}\n"
        "print(table[got[0]], table[got[1]])\n"
    )
    import pickle

    data = pickle.dumps([Action(Kind.F, 2, 0), Action(Kind.RELOAD, 1)])
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=data,
            capture_output=True,
            timeout=60,
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
            check=True,
        )
        assert out.stdout.decode().split() == ["f", "w"]
