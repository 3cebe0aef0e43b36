"""The dependency model's questions beyond ``requires``: transfers per action, planned
schedules, the schedule a pass is about to make, and where weights start."""

from __future__ import annotations

import pytest

from zeropipe.core.deps import Dependencies, offloaded_at_start
from zeropipe.core.ir import Action, Kind, Schedule
from zeropipe.core.passes.fit import checkpoint, offload, offload_weights
from zeropipe.core.passes.lower import lower
from zeropipe.core.schedules import generate


def A(text: str) -> Action:
    return Action.parse(text)


def test_comm_of_matches_the_transfers_lowering_inserts() -> None:
    for name, chunks in (("1f1b", 1), ("zbv", 2), ("interleaved-1f1b", 2)):
        sched = generate(name, 3, 4, chunks)
        deps = Dependencies(sched)
        paired = set()
        for acts in sched.actions:
            for a in acts:
                incoming, outgoing = deps.comm_of(a)
                paired.update(incoming)
                paired.update(outgoing)
        # Every boundary transfer is seen once from each end, and nothing else.
        want = {deps.comm_pair(*t) for t in deps.transfers()}
        assert paired == want, name
        lowered = lower(sched)
        comm = {
            a for acts in lowered.actions for a in acts if a.kind.value.startswith(("SEND", "RECV"))
        }
        assert comm == {x for pair in want for x in pair}


def test_comm_of_on_a_v_placement() -> None:
    deps = Dependencies(generate("zbv", 2, 2))
    assert deps.placement == (0, 1, 1, 0)
    # Stage 1 receives from rank 0 and hands its output to stage 2 on its own rank.
    assert deps.comm_of(A("1F0")) == (((A("0SEND_F0"), A("1RECV_F0")),), ())
    assert deps.comm_of(A("1I0")) == ((), ((A("1SEND_B0"), A("0RECV_B0")),))
    assert deps.comm_of(A("3F0")) == (((A("2SEND_F0"), A("3RECV_F0")),), ())
    assert deps.comm_of(A("1W0")) == ((), ())


@pytest.mark.parametrize("split", [True, False])
def test_a_planned_schedule_says_which_backward_it_will_have(split: bool) -> None:
    deps = Dependencies.planned((0, 1, 2), 4, split=split)
    back = Kind.I if split else Kind.B
    assert deps.backward(1, 3).kind is back
    need = {d.action for d in deps.requires(Action(back, 1, 3))}
    assert need == {A("1F3"), Action(back, 2, 3)}
    assert all(d.transfer for d in deps.requires(Action(back, 1, 3)) if d.action.stage == 2)


def test_with_actions_sees_the_inserted_recompute_and_offload() -> None:
    sched = generate("1f1b", 2, 2)
    deps = Dependencies(sched)
    assert deps.saved_reader(0, 1) == A("0B1")
    planned = deps.with_actions([A("0R1"), A("0OFFLOAD1"), A("0RELOAD1")])
    assert planned.saved_reader(0, 1) == A("0R1")
    assert planned.upstream(A("0R1")) == {A("0F1"), A("0RELOAD1"), A("0OFFLOAD1")}
    assert planned.upstream(A("0B1")) >= {A("0R1"), A("0F1")}
    assert not deps.checkpointed(0, 1)  # the original is left as it was
    real = offload(checkpoint(sched, [(0, 1)]), [(0, 1)])
    assert Dependencies(real).upstream(A("0R1")) == planned.upstream(A("0R1"))


def test_weights_whose_first_copy_is_a_reload_start_offloaded() -> None:
    sched = offload_weights(generate("interleaved-1f1b", 2, 4, 2), [0])
    assert next(a for a in sched.actions[0] if a.is_weight_copy) == A("0RELOAD")
    assert offloaded_at_start(sched, 0) == {0}  # stage 2 on rank 0 stays resident
    assert offloaded_at_start(sched, 1) == frozenset()
    assert offloaded_at_start(generate("1f1b", 2, 3), 0) == frozenset()
    manual = Schedule((0,), [[A("0RELOAD"), A("0F0"), A("0B0"), A("0OFFLOAD")]], 1)
    assert offloaded_at_start(manual, 0) == {0}
