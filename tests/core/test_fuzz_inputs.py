"""Bad input fails cleanly: random malformed schedules and cost models, read, checked and run.

Every reader (schedule text, JSON, torch CSV; cost specs and cost JSON) is fed
valid input with random damage, or plain garbage, and must either give a
result or raise a :class:`~zeropipe.core.errors.ZeropipeError` -- never an
IndexError, TypeError, RecursionError or a timeline with negative times.  A
schedule that reads is also validated and, if valid, simulated, since bad
input that slips past a reader surfaces there.

Bounded and derandomized, so CI runs the same cases every time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.strategies import valid_schedules
from zeropipe.core.costs import CostModel, StageCost
from zeropipe.core.errors import ZeropipeError
from zeropipe.core.ir import Schedule
from zeropipe.core.schedules import generate
from zeropipe.core.simulate import simulate
from zeropipe.core.validate import validate

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Characters the formats are made of, plus some that have no business there.
_SCHEDULE_CHARS = '0123456789FBIWRSENDCVOLAfb_,:# -\n"[]{}.x\x00é'
_COST_CHARS = "0123456789.,=-+eEFBIWRnaifcomtpsu_ \x00"

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(_SCHEDULE_CHARS, max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


@st.composite
def _damaged(draw: st.DrawFn, text: str, alphabet: str) -> str:
    """``text`` with a few random cuts, insertions and replacements."""
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 3))
        new = draw(st.text(alphabet, max_size=3))
        text = text[:at] + new + text[at + cut :]
    return text


def _read_check_run(read: Callable[[], Schedule]) -> None:
    """A schedule, validated and simulated; or a ZeropipeError on the way there."""
    try:
        schedule = read()
        graph = validate(schedule)
        timeline = simulate(schedule, graph=graph)
    except ZeropipeError:
        return
    assert all(e.end >= e.start >= 0 for evs in timeline.events for e in evs)


@FUZZ
@given(st.data(), valid_schedules(max_ranks=3, max_mb=3))
def test_damaged_schedule_text_json_and_csv(data: st.DataObject, schedule: Schedule) -> None:
    form = data.draw(st.sampled_from(["text", "json", "csv"]))
    if form == "text":
        text = data.draw(_damaged(schedule.to_text(), _SCHEDULE_CHARS))
        _read_check_run(lambda: Schedule.from_text(text))
    elif form == "json":
        text = data.draw(_damaged(schedule.to_json(), _SCHEDULE_CHARS))
        _read_check_run(lambda: Schedule.from_json(text))
    else:
        clean = schedule.replace_actions(
            [[a for a in acts if a.kind.value in "FBIW"] for acts in schedule.actions]
        )
        text = data.draw(_damaged(clean.to_torch_csv(), _SCHEDULE_CHARS))
        mbs = data.draw(st.none() | st.integers(-1, 4))
        _read_check_run(lambda: Schedule.from_torch_csv(text, microbatches=mbs))


@FUZZ
@given(st.data(), valid_schedules(max_ranks=3, max_mb=3))
def test_schedule_json_with_a_field_of_the_wrong_shape(
    data: st.DataObject, schedule: Schedule
) -> None:
    raw: dict[str, Any] = schedule.to_dict()
    key = data.draw(st.sampled_from(["microbatches", "placement", "actions", "name", "format"]))
    if data.draw(st.booleans()):
        raw[key] = data.draw(_json_values)
    elif data.draw(st.booleans()):
        del raw[key]
    elif raw["actions"] and raw["actions"][0]:
        raw["actions"][0][0] = data.draw(_json_values)
    _read_check_run(lambda: Schedule.from_dict(raw))
    _read_check_run(lambda: Schedule.from_json(json.dumps(raw)))


@FUZZ
@given(st.text(_SCHEDULE_CHARS, max_size=60), st.sampled_from(["text", "json", "csv"]))
def test_garbage_schedules(text: str, form: str) -> None:
    read = {"text": Schedule.from_text, "json": Schedule.from_json}.get(
        form, Schedule.from_torch_csv
    )
    _read_check_run(lambda: read(text))


def _assert_sane(model: CostModel) -> None:
    """What the checks promise of every model that gets built."""
    for stage in model.stages:
        for name, value in vars(stage).items():
            assert value is None or (math.isfinite(value) and value >= 0), (name, value)
    assert min(model.latency, model.post, model.overhead) >= 0
    assert model.bandwidth > 0


_cost_keys = st.sampled_from(
    ["F", "B", "I", "W", "R", "W_fused", "comm", "act_w", "overhead", "post", "Q", ""]
)
_cost_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(-5, 5).map(str),
    st.sampled_from(
        ["nan", "inf", "-inf", "1e400", "1e308", "5e-324", "-0", "", "x", "1_0", " 2 "]
    ),
)


@FUZZ
@given(
    st.one_of(
        st.lists(st.tuples(_cost_keys, _cost_numbers), max_size=4).map(
            lambda kv: ",".join(f"{k}={v}" for k, v in kv)
        ),
        st.text(_COST_CHARS, max_size=30),
    ),
    st.integers(1, 4),
    st.integers(1, 3),
)
def test_cost_specs(spec: str, stages: int, chunks: int) -> None:
    try:
        model = CostModel.parse(spec, stages * chunks, chunks)
    except ZeropipeError:
        return
    _assert_sane(model)
    schedule = generate("interleaved-1f1b" if chunks > 1 else "1f1b", stages, 4, chunks)
    try:
        timeline = simulate(schedule, model)
    except ZeropipeError:  # finite figures whose sums overflow
        return
    assert all(e.end >= e.start >= 0 for evs in timeline.events for e in evs)
    assert math.isfinite(timeline.makespan) and 0 <= timeline.bubble_rate <= 1


_stage_fields = [f for f in StageCost.__dataclass_fields__]


@FUZZ
@given(st.data(), st.integers(1, 3))
def test_cost_json_with_a_bad_field(data: st.DataObject, stages: int) -> None:
    raw: dict[str, Any] = CostModel.uniform(stages, comm=0.5).to_dict()
    where = data.draw(st.sampled_from(["model", "stage", "text"]))
    if where == "model":
        key = data.draw(
            st.sampled_from(["latency", "bandwidth", "overhead", "post", "unit", "meta", "stages"])
        )
        raw[key] = data.draw(_json_values)
        text = json.dumps(raw)
    elif where == "stage":
        n = data.draw(st.integers(0, stages - 1))
        key = data.draw(st.sampled_from([*_stage_fields, "bogus"]))
        raw["stages"][n][key] = data.draw(_json_values)
        text = json.dumps(raw)
    else:
        text = data.draw(_damaged(json.dumps(raw), _COST_CHARS + '{}[]":'))
    try:
        model = CostModel.from_json(text)
    except ZeropipeError:
        return
    _assert_sane(model)
    schedule = Schedule.from_text(
        "microbatches: 2\nplacement: 0 1 2\n"
        "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1F1 1B0 1B1\nrank 2: 2F0 2B0 2F1 2B1\n"
    )
    if len(model.stages) == 3:
        timeline = simulate(schedule, model)
        assert all(e.end >= e.start >= 0 for evs in timeline.events for e in evs)
