"""IR: canonical action text, schedule text/JSON/torch-CSV round-trips, grid rendering."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings

from tests.strategies import valid_schedules
from zeropipe.core.errors import ScheduleError
from zeropipe.core.ir import Action, Kind, Schedule, format_grid
from zeropipe.core.passes.lower import lower


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
        "from zeropipe.core.ir import Action, Kind\n"
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


# -- malformed input is a ScheduleError that names what is wrong -------------------------
def _json(**changes: object) -> str:
    data: dict[str, object] = {
        "format": "zeropipe-schedule",
        "microbatches": 1,
        "placement": [0, 1],
        "actions": [["0F0", "0B0"], ["1F0", "1B0"]],
    }
    data.update(changes)
    return json.dumps({k: v for k, v in data.items() if v is not _DROP})


_DROP = object()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (_json(microbatches="two"), "microbatches must be an integer, got 'two'"),
        (_json(microbatches=[2]), "microbatches must be an integer"),
        (_json(microbatches=1.5), "microbatches must be an integer"),
        (_json(microbatches=0), "microbatches must be >= 1"),
        (_json(microbatches=-3), "microbatches must be >= 1"),
        (_json(microbatches=_DROP), "lacks field 'microbatches'"),
        (_json(actions=_DROP), "lacks field 'actions'"),
        (_json(placement="0 1"), "'placement' must be a list"),
        (_json(placement=[0, "x"]), "placement must be an integer, got 'x'"),
        (_json(placement=[0, None]), "placement must be an integer, got None"),
        (_json(placement=[0, 5]), "names rank(s) [5]"),
        (_json(placement=[]), "at least one stage"),
        (_json(actions={"0": []}), "'actions' must be a list"),
        (_json(actions=[["0F0", 3], []]), "rank 0: action 3 is not a string"),
        (_json(actions=[["0F0", None], []]), "rank 0: action None is not a string"),
        (_json(actions=[["0Q0"], []]), "cannot read action '0Q0'"),
        (_json(actions=[["0F0", "0B0"], ["1F0", "3F0"]]), "action 3F0 on rank 1: stage 3 is not"),
        (_json(format="other"), "not a zeropipe schedule"),
        ("[1, 2]", "not a zeropipe schedule"),
        ("{", "not valid JSON"),
        ("[" * 100_000, "not valid JSON"),
    ],
)
def test_malformed_schedule_json_is_a_schedule_error(text: str, message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule.from_json(text)
    assert message in str(info.value)


def test_stage_beyond_the_placement_names_the_action_in_every_reader() -> None:
    want = "action 3F0 on rank 1: stage 3 is not in the placement (stages 0-1)"
    text = "microbatches: 1\nplacement: 0 1\nrank 0: 0F0 0B0\nrank 1: 1F0 3F0 1B0\n"
    with pytest.raises(ScheduleError, match=re.escape(want)) as info:
        Schedule.from_text(text)
    assert info.value.actions == ("3F0",) and info.value.rule == "range"
    with pytest.raises(ScheduleError, match=re.escape(want)):
        Schedule.from_torch_csv("0F0,0B0\n1F0,3F0,1B0\n", placement=[0, 1])
    # Placement inferred: the gap (stage 2) is reported along with the action past it.
    with pytest.raises(ScheduleError, match=r"action 3F0 on rank 1 .* stage\(s\) \[2\]"):
        Schedule.from_torch_csv("0F0,0B0\n1F0,3F0,1B0\n")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("microbatches: two\nplacement: 0\nrank 0: 0F0 0B0\n", "got 'two'"),
        ("microbatches: 0\nplacement: 0\nrank 0: 0F0 0B0\n", "microbatches must be >= 1"),
        ("microbatches: 1\nplacement: 0 x\nrank 0: 0F0 0B0\n", "placement must be an integer"),
        ("microbatches: 1\nplacement: -1\nrank 0: 0F0\n", "names rank(s) [-1]"),
        ("microbatches: 1\nrank 0: 0F0\n", "no 'placement:' line"),
        ("microbatches: 1\nplacement: 0\n", "at least one rank"),
        ("microbatches: 1\nplacement: 0\nrank 1: 0F0\n", "expected 0..0"),
    ],
)
def test_malformed_schedule_text_is_a_schedule_error(text: str, message: str) -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule.from_text(text)
    assert message in str(info.value)


def test_oversized_csv_field_is_a_schedule_error() -> None:
    with pytest.raises(ScheduleError, match="cannot read torch CSV"):
        Schedule.from_torch_csv('"' + "0F0" * 100_000 + '"\n')


def test_constructor_rejects_what_is_not_an_action_or_an_integer() -> None:
    with pytest.raises(ScheduleError, match="is not an Action"):
        Schedule((0,), [["0F0"]], 1)  # type: ignore[list-item]
    with pytest.raises(ScheduleError, match="microbatches must be an integer"):
        Schedule((0,), [[]], "1")  # type: ignore[arg-type]
    with pytest.raises(ScheduleError, match="one sequence of Actions per rank"):
        Schedule((0,), 5, 1)  # type: ignore[arg-type]


def test_stages_of_is_built_once_and_matches_the_placement() -> None:
    sched = Schedule((0, 1, 1, 0), [[], []], 1)
    assert [sched.stages_of(r) for r in range(3)] == [(0, 3), (1, 2), ()]
    assert sched.chunks_per_rank == 2
