"""Backward priority: the recorded node order changes as asked, gradients do not.

Orders are read from the engine itself (node pre-hooks via
record_backward_order), so these tests pin real engine behaviour, not our
model of it; predict_backward_order is checked against the same records.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from zeropipe.autograd import priority as prio
from zeropipe.autograd.priority import (
    PriorityError,
    PriorityNotAppliedWarning,
    PriorityUnsupportedError,
    check_priority_support,
    predict_backward_order,
    prioritize,
    prioritize_outputs,
    record_backward_order,
)
from zeropipe.base import _compat
from zeropipe.core.errors import ZeropipeError

D = torch.float64


def _branches(n: int, seed: int = 0) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """``n`` independent branches from one input; branch 0 is created first."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, dtype=D, generator=g)
    ws = [torch.randn(3, 3, dtype=D, generator=g).requires_grad_() for _ in range(n)]
    outs = [(x @ w).tanh().sin().sum() for w in ws]
    return x, ws, outs


def _run(outs: list[Tensor], ws: list[Tensor]) -> tuple[list[int], list[Tensor]]:
    """Backward of sum(outs); the position at which each branch's weight got its gradient."""
    loss = torch.stack(outs).sum()
    with record_backward_order(loss) as rec:
        loss.backward()
    grads = [w.grad.clone() for w in ws if w.grad is not None]
    return [rec.position(w) for w in ws], grads


def test_default_order_runs_the_later_branch_first() -> None:
    # The baseline that makes priority worth having: creation order decides.
    _, ws, outs = _branches(2)
    pos, _ = _run(outs, ws)
    assert pos[1] < pos[0]


def test_prioritize_runs_the_marked_branch_first_and_keeps_gradients() -> None:
    _, ws, outs = _branches(2)
    _, plain = _run(outs, ws)

    _, ws, outs = _branches(2)
    mark = prioritize(outs[0])
    assert mark.applied and mark.nodes == 4  # sum, sin, tanh, mm
    loss = torch.stack(outs).sum()
    with record_backward_order(loss) as rec:
        loss.backward()
    # Every node of branch 0 (down to its weight) before any node of branch 1.
    assert rec.position(ws[0]) < rec.position(outs[1])
    assert all(torch.equal(w.grad, g) for w, g in zip(ws, plain, strict=True))


def test_late_runs_the_marked_branch_after_the_rest() -> None:
    _, ws, outs = _branches(2)
    prioritize(outs[1], late=True)
    loss = torch.stack(outs).sum()
    with record_backward_order(loss) as rec:
        loss.backward()
    assert rec.position(ws[0]) < rec.position(outs[1])


def test_higher_level_runs_first() -> None:
    _, ws, outs = _branches(3)
    prioritize(outs[0], level=1)
    prioritize(outs[1], level=2)
    pos, _ = _run(outs, ws)
    assert pos[1] < pos[0] < pos[2]


def test_stop_at_leaves_the_shared_trunk_alone() -> None:
    x = torch.randn(4, 3, dtype=D)
    w0, wa, wb = (torch.randn(3, 3, dtype=D, requires_grad=True) for _ in range(3))
    h = (x @ w0).tanh()
    a = (h @ wa).sin().sum()
    b = (h @ wb).sin().sum()
    assert h.grad_fn is not None
    trunk = _compat.get_sequence_nr(h.grad_fn)
    mark = prioritize(a, stop_at=h)
    assert mark.nodes == 3  # sum, sin, mm of branch a only
    assert _compat.get_sequence_nr(h.grad_fn) == trunk
    pos, _ = _run([a, b], [wa, wb])
    assert pos[0] < pos[1]


def test_prioritize_outputs_marks_only_what_the_module_computed() -> None:
    torch.manual_seed(0)
    trunk = nn.Linear(3, 3).to(D)
    early = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).to(D)
    other = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).to(D)
    handle = prioritize_outputs(early)
    x = torch.randn(4, 3, dtype=D)
    h = trunk(x)
    a = early(h)  # created first: would run last without the hook
    b = other(h)
    assert h.grad_fn is not None
    assert prio._ORIGINAL_KEY not in h.grad_fn.metadata
    # The outputs feed one node, so both become ready together and the mark
    # decides; a later unmarked op on `a` alone (a.sum()) would be ready only
    # after the higher-numbered `b` chain, and the mark could not help.
    loss = (a + b).sum()
    with record_backward_order(loss) as rec:
        loss.backward()
    assert rec.position(early[0].weight) < rec.position(b)

    handle.remove()
    a2 = early(trunk(x))
    assert a2.grad_fn is not None
    assert prio._ORIGINAL_KEY not in a2.grad_fn.metadata


def test_marking_again_starts_from_the_original_number() -> None:
    _, _, outs = _branches(1)
    node = outs[0].grad_fn
    assert node is not None
    original = _compat.get_sequence_nr(node)
    prioritize(outs[0], level=3)
    first = _compat.get_sequence_nr(node)
    prioritize(outs[0], level=3)
    assert _compat.get_sequence_nr(node) == first == 3 * 2**56 + original
    prioritize(outs[0], late=True)
    assert _compat.get_sequence_nr(node) == 3  # highest of 4 ranks: still last-created first


def test_bad_requests_raise_typed_errors() -> None:
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(PriorityError, match="level"):
        prioritize(x * 2, level=0)
    with pytest.raises(PriorityError, match="level"):
        prioritize_outputs(nn.Linear(2, 2), level=prio.MAX_PRIORITY_LEVEL + 1)
    with pytest.raises(PriorityError, match="does not require grad"):
        prioritize(torch.ones(2))
    assert prioritize(x).nodes == 0  # a leaf: AccumulateGrad already runs first
    assert issubclass(PriorityError, ZeropipeError)


def _order_unchanged_when(
    monkeypatch: pytest.MonkeyPatch, name: str, value: Callable[..., object]
) -> None:
    monkeypatch.setattr(_compat, name, value)
    _, ws, outs = _branches(2)
    with pytest.warns(PriorityNotAppliedWarning, match="not applied"):
        mark = prioritize(outs[0])
    assert not mark.applied and mark.reason
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PriorityNotAppliedWarning)  # from the recorder
        pos, _ = _run(outs, ws)
    assert pos[1] < pos[0]  # the default order
    with pytest.raises(PriorityUnsupportedError, match="not applied"):
        prioritize(outs[0], strict=True)
    with pytest.warns(PriorityNotAppliedWarning):
        assert not check_priority_support()


def test_torch_without_set_sequence_nr_warns_or_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _order_unchanged_when(monkeypatch, "sequence_nr_settable", lambda node: False)


def test_compiled_autograd_warns_or_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    _order_unchanged_when(monkeypatch, "compiled_autograd_reason", lambda: "compiled autograd on")
    _, _, outs = _branches(1)
    with (
        pytest.warns(PriorityNotAppliedWarning, match="compiled autograd"),
        record_backward_order(outs[0]),
    ):
        pass


def test_real_compiled_autograd_ignores_priority_and_is_detected() -> None:
    try:
        from torch._dynamo import compiled_autograd
    except Exception as exc:  # pragma: no cover - platform without dynamo
        pytest.skip(f"torch._dynamo unavailable: {exc}")
    _, ws, outs = _branches(2)
    prioritize(outs[0])  # applied: compiled autograd is not on yet
    with compiled_autograd._enable(lambda gm: gm):
        with pytest.warns(PriorityNotAppliedWarning, match="compiled autograd"):
            assert not check_priority_support()
        with pytest.warns(PriorityNotAppliedWarning):
            prioritize(outs[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PriorityNotAppliedWarning)
            pos, _ = _run(outs, ws)
    # Why the warning exists: the mark made before was ignored.
    assert pos[1] < pos[0]
    assert check_priority_support()


def test_record_removes_its_hooks_and_times_nodes() -> None:
    _, ws, outs = _branches(1)
    with record_backward_order(outs[0]) as rec:
        outs[0].backward(retain_graph=True)
    n = len(rec)
    assert n == 5 and rec.names()[-1] == _compat.ACCUMULATE_GRAD_NAME
    assert all(e.end is not None and e.end >= e.start for e in rec)
    assert 0 <= rec.done_after(outs[0]) <= rec.done_after(ws[0])
    outs[0].backward()
    assert len(rec) == n
    with pytest.raises(ZeropipeError, match="did not run"):
        rec.position(torch.ones(2, requires_grad=True))


# --- predict == record on random graphs -------------------------------------

_UNARY: list[Callable[[Tensor], Tensor]] = [torch.sin, torch.tanh, torch.exp, lambda t: t * 3]


def _random_graph(rng: random.Random) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    leaves = [torch.randn(3, dtype=D, requires_grad=True) for _ in range(rng.randint(1, 4))]
    pool: list[Tensor] = list(leaves)
    made: list[Tensor] = []
    for _ in range(rng.randint(3, 14)):
        a = rng.choice(pool)
        t = rng.choice(_UNARY)(a)
        if rng.random() < 0.4:
            t = t + rng.choice(pool)  # shared inputs: nodes with several consumers
        pool.append(t)
        made.append(t)
    outs = rng.sample(made, rng.randint(1, min(3, len(made))))
    loss = torch.stack([o.sum() for o in outs]).sum()
    return loss, leaves, made


def _canonical(nodes: list[torch.autograd.graph.Node]) -> list[object]:
    # AccumulateGrad nodes ready together tie (same number); the engine runs
    # them in either order and they feed nothing, so compare them as sets.
    out: list[object] = []
    for n in nodes:
        if n.name() == _compat.ACCUMULATE_GRAD_NAME:
            if out and isinstance(out[-1], set):
                out[-1].add(n)
                continue
            out.append({n})
        else:
            out.append(n)
    return out


@pytest.mark.parametrize("seed", range(25))
def test_predict_matches_record_and_gradients_do_not_change(seed: int) -> None:
    # Late marks rank nodes 0..n-1; keep every unmarked number above that.
    while _compat.thread_sequence_nr() < 10_000:
        torch.ones(1, requires_grad=True) * 1
    rng = random.Random(seed)
    torch.manual_seed(seed)
    loss, leaves, made = _random_graph(rng)
    loss.backward(retain_graph=True)
    plain = [t.grad.clone() for t in leaves if t.grad is not None]
    for t in leaves:
        t.grad = None

    late_used = False
    for t in rng.sample(made, rng.randint(0, 3)):
        late = not late_used and rng.random() < 0.3
        late_used |= late
        prioritize(t, late=late, level=rng.randint(1, 3))
    predicted = predict_backward_order(loss)
    with record_backward_order(loss) as rec:
        loss.backward()
    assert _canonical(rec.nodes()) == _canonical(predicted)
    marked = [t.grad for t in leaves if t.grad is not None]
    assert len(marked) == len(plain)
    # Exact but for summation order: a tensor with three or more consumers
    # adds their gradients in run order (float addition is not associative).
    for a, b in zip(marked, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14 * float(b.abs().max()))
