"""parallel_map / ParallelBranches: plain autograd's gradients, concurrency, errors, nesting.

Gradients are compared bitwise in float64 against the same branches run
without parallel_map.  Concurrency is shown with barriers that only open
when two branches are inside them at the same time, forward and backward.
"""

from __future__ import annotations

import copy
import pickle
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from zeropipe.autograd.parallel import (
    BranchError,
    BranchPool,
    ParallelBranches,
    ParallelMapError,
    default_branch_pool,
    parallel_map,
)
from zeropipe.core.errors import ZeropipeError

D = torch.float64


@pytest.fixture
def pool() -> Any:
    with BranchPool(max_workers=2) as p:
        yield p


def _mlp(seed: int, width: int = 6) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 3)).to(D)


def _grads(*tensors: Tensor) -> list[Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def _zero(*tensors: Tensor) -> None:
    for t in tensors:
        t.grad = None


def _same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _loss(outs: list[Any]) -> Tensor:
    flat = [o for out in outs for o in (out if isinstance(out, (tuple, list)) else [out])]
    return sum(
        ((o.to(D) ** 2).sum() * (k + 1) for k, o in enumerate(flat)), torch.zeros((), dtype=D)
    )


def _check_equal(
    make: Callable[[], tuple[Callable[[], list[Any]], Callable[[], list[Any]], list[Tensor]]],
) -> None:
    """Run ``parallel`` and ``plain`` on the same leaves; every leaf's .grad must be bitwise equal."""
    parallel, plain, leaves = make()
    _zero(*leaves)
    _loss(parallel()).backward()
    got = _grads(*leaves)
    _zero(*leaves)
    _loss(plain()).backward()
    assert _same(got, _grads(*leaves))
    assert any(g is not None for g in got)


# --- gradients ---------------------------------------------------------------


def test_modules_form_equals_plain_autograd(pool: BranchPool) -> None:
    mods = nn.ModuleList(_mlp(i) for i in range(3))
    xs = [torch.randn(5, 6, dtype=D, requires_grad=True) for _ in range(3)]
    leaves = [*mods.parameters(), *xs]
    _check_equal(
        lambda: (
            lambda: parallel_map(mods, xs, pool=pool),
            lambda: [m(x) for m, x in zip(mods, xs, strict=True)],
            leaves,
        )
    )


def test_shared_module_and_shared_input_equal_plain_autograd(pool: BranchPool) -> None:
    mod = _mlp(0)
    x = torch.randn(5, 6, dtype=D, requires_grad=True)
    leaves = [*mod.parameters(), x]
    # One module over two inputs made from one tensor: leaves shared by branches.
    _check_equal(
        lambda: (
            lambda: parallel_map(mod, [x, x * 2], pool=pool),
            lambda: [mod(x), mod(x * 2)],
            leaves,
        )
    )
    towers = ParallelBranches([_mlp(1), _mlp(2)], pool=pool)
    leaves = [*towers.parameters(), x]
    _check_equal(
        lambda: (
            lambda: towers(x),
            lambda: [t(x) for t in towers.branches],
            leaves,
        )
    )


def test_tuple_outputs_extra_args_and_non_differentiable_outputs(pool: BranchPool) -> None:
    w = torch.randn(6, 6, dtype=D, requires_grad=True)
    xs = [torch.randn(4, 6, dtype=D, requires_grad=True) for _ in range(2)]

    def branch(x: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        y = (x @ w).sin() * scale
        return y, y.argmax(dim=1), x.cos()

    outs = parallel_map(branch, [(xs[0], 2.0), (xs[1], 3.0)], pool=pool)
    assert isinstance(outs[0], tuple) and len(outs[0]) == 3
    assert not outs[0][1].requires_grad and outs[0][1].dtype == torch.int64
    loss = sum(((o[0] ** 2).sum() + o[2].sum() for o in outs), torch.zeros((), dtype=D))
    loss.backward()
    got = _grads(w, *xs)
    _zero(w, *xs)
    plain = [branch(xs[0], 2.0), branch(xs[1], 3.0)]
    sum(((o[0] ** 2).sum() + o[2].sum() for o in plain), torch.zeros((), dtype=D)).backward()
    assert _same(got, _grads(w, *xs))


def test_branch_may_return_its_input_or_a_parameter(pool: BranchPool) -> None:
    w = torch.randn(3, dtype=D, requires_grad=True)
    x = torch.randn(3, dtype=D, requires_grad=True)
    outs = parallel_map([lambda t: t, lambda t: w], [x, x], pool=pool)
    (outs[0] * 2 + outs[1] * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0, dtype=D))
    assert torch.equal(w.grad, torch.full((3,), 3.0, dtype=D))


def test_closure_over_a_leaf_gets_its_gradient(pool: BranchPool) -> None:
    w = torch.randn(6, dtype=D, requires_grad=True)
    xs = [torch.randn(6, dtype=D) for _ in range(2)]
    _check_equal(
        lambda: (
            lambda: parallel_map(lambda t: (t * w).exp(), xs, pool=pool),
            lambda: [(t * w).exp() for t in xs],
            [w],
        )
    )


def test_existing_grad_accumulates_and_hooks_run_once_on_the_engine_thread(
    pool: BranchPool,
) -> None:
    mods = nn.ModuleList(_mlp(i) for i in range(2))
    xs = [torch.randn(5, 6, dtype=D) for _ in range(2)]
    seen: list[threading.Thread] = []
    for p in mods.parameters():
        p.grad = torch.ones_like(p)
        p.register_post_accumulate_grad_hook(lambda _p: seen.append(threading.current_thread()))
    _loss(parallel_map(mods, xs, pool=pool)).backward()
    got = _grads(*mods.parameters())
    assert len(seen) == len(got) and set(seen) == {threading.current_thread()}
    for p in mods.parameters():
        p.grad = torch.ones_like(p)
    _loss([m(x) for m, x in zip(mods, xs, strict=True)]).backward()
    assert _same(got, _grads(*mods.parameters()))


def test_grad_wrt_inputs_only_leaves_parameters_untouched(pool: BranchPool) -> None:
    mods = nn.ModuleList(_mlp(i) for i in range(2))
    xs = [torch.randn(5, 6, dtype=D, requires_grad=True) for _ in range(2)]
    got = torch.autograd.grad(_loss(parallel_map(mods, xs, pool=pool)), xs)
    want = torch.autograd.grad(_loss([m(x) for m, x in zip(mods, xs, strict=True)]), xs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(p.grad is None for p in mods.parameters())


# --- grad mode, thread state -------------------------------------------------


def test_no_grad_runs_forward_only_and_allows_any_output(pool: BranchPool) -> None:
    mod = _mlp(0)
    seen: list[bool] = []

    def branch(x: Tensor) -> dict[str, Tensor]:
        seen.append(torch.is_grad_enabled())
        return {"y": mod(x)}

    with torch.no_grad():
        outs = parallel_map(branch, [torch.randn(2, 6, dtype=D) for _ in range(3)], pool=pool)
    assert seen == [False] * 3
    assert all(o["y"].grad_fn is None for o in outs)


def test_autocast_and_saved_tensor_hooks_reach_branch_threads(pool: BranchPool) -> None:
    packed: list[threading.Thread] = []

    def pack(t: Tensor) -> Tensor:
        packed.append(threading.current_thread())
        return t

    lin = nn.Linear(8, 8)
    xs = [torch.randn(4, 8) for _ in range(4)]
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        before = lin(xs[0])  # fills the caller's autocast cast cache with lin.weight
        outs = parallel_map(lin, xs, pool=pool)
    assert all(o.dtype == torch.bfloat16 for o in outs)
    assert len(packed) >= 4  # every branch saved tensors through the hook
    (before.float().sum() + sum(o.float().sum() for o in outs)).backward()
    got = _grads(lin.weight, lin.bias)
    _zero(lin.weight, lin.bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = [lin(xs[0]), *(lin(x) for x in xs)]
    sum(o.float().sum() for o in plain).backward()
    # Not bitwise: branches cast weights themselves (no cache), so the bf16
    # gradients of the casts are summed in float32 instead of bfloat16 first.
    for a, b in zip(got, _grads(lin.weight, lin.bias), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


# --- concurrency ----------------------------------------------------------------


class _Meet(torch.autograd.Function):
    """Identity whose backward waits until ``parties`` backwards are inside it at once."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, barrier: threading.Barrier) -> Tensor:
        ctx.barrier = barrier
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        ctx.barrier.wait()
        return g, None


def test_forward_and_backward_of_branches_overlap() -> None:
    # One worker plus the calling thread: exactly two branches at a time.
    fwd = threading.Barrier(2, timeout=10)
    bwd = threading.Barrier(2, timeout=10)

    def branch(x: Tensor) -> Tensor:
        fwd.wait()  # serial execution would break the barrier
        return _Meet.apply(x.sin(), bwd)

    xs = [torch.randn(3, dtype=D, requires_grad=True) for _ in range(2)]
    with BranchPool(max_workers=1) as pool:
        outs = parallel_map(branch, xs, pool=pool)
        _loss(outs).backward()
    assert all(x.grad is not None for x in xs)


# --- errors ---------------------------------------------------------------------


def test_exception_in_forward_names_the_branch(pool: BranchPool) -> None:
    finished: list[int] = []
    started = threading.Event()

    # The failing branch fails only once the healthy one is running, so the
    # documented rule applies deterministically: a running branch finishes
    # (one not yet started would be skipped).
    def ok(x: Tensor) -> Tensor:
        started.set()
        time.sleep(0.05)
        finished.append(1)
        return x * 2

    def bad(x: Tensor) -> Tensor:
        started.wait(5)
        raise ValueError("expert exploded")

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(BranchError, match=r"branch 1 \(.*bad\) failed in forward.*exploded") as e:
        parallel_map([ok, bad], [x, x], pool=pool)
    assert e.value.branch == 1 and e.value.phase == "forward"
    assert isinstance(e.value.__cause__, ValueError)
    assert isinstance(e.value, ZeropipeError)
    assert finished == [1]


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        raise FloatingPointError("bad gradient")


def test_exception_in_backward_names_the_branch(pool: BranchPool) -> None:
    fns = [torch.sin, torch.cos, _FailBackward.apply]
    x = torch.randn(3, dtype=D, requires_grad=True)
    outs = parallel_map(fns, [x, x, x], pool=pool)
    with pytest.raises(BranchError, match=r"branch 2 .*failed in backward.*bad gradient") as e:
        _loss(outs).backward()
    assert e.value.branch == 2 and e.value.phase == "backward"


def test_captured_non_leaf_is_rejected_with_advice(pool: BranchPool) -> None:
    x = torch.randn(3, requires_grad=True)
    h = x.exp()  # a non-leaf from outside the branch
    with pytest.raises(BranchError, match="Pass that tensor as an input") as e:
        parallel_map(lambda t: t * h, [x, x], pool=pool)
    assert isinstance(e.value.__cause__, ParallelMapError)
    outs = parallel_map(lambda t, hh: t * hh, [(x, h), (x, h)], pool=pool)  # the fix
    _loss(outs).backward()
    assert x.grad is not None


def test_output_of_wrong_type_under_grad(pool: BranchPool) -> None:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(BranchError, match="must return a Tensor"):
        parallel_map(lambda t: {"y": t * 2}, [x], pool=pool)


def test_second_backward_and_double_backward_raise(pool: BranchPool) -> None:
    x = torch.randn(3, dtype=D, requires_grad=True)
    loss = _loss(parallel_map(torch.sin, [x, x], pool=pool))
    loss.backward(retain_graph=True)
    with pytest.raises(ParallelMapError, match="retain_graph"):
        loss.backward()
    loss = _loss(parallel_map(torch.sin, [x, x], pool=pool))
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        g.sum().backward()


def test_bad_arguments(pool: BranchPool) -> None:
    x = torch.randn(3)
    with pytest.raises(ParallelMapError, match="2 branches but 1 inputs"):
        parallel_map([torch.sin, torch.cos], [x], pool=pool)
    with pytest.raises(ParallelMapError, match="callable"):
        parallel_map(3, [x], pool=pool)  # type: ignore[arg-type]
    with pytest.raises(ParallelMapError, match="max_workers"):
        BranchPool(max_workers=0)
    assert parallel_map(torch.sin, [], pool=pool) == []


# --- pools, nesting, stress ------------------------------------------------------


def test_pool_copies_pickles_and_reopens() -> None:
    pool = BranchPool(max_workers=3)
    assert parallel_map(lambda t: t + 1, [torch.zeros(1)] * 3, pool=pool)[2].item() == 1
    for clone in (copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        assert clone is not pool and clone.max_workers == 3
    pool.close()
    assert parallel_map(lambda t: t + 1, [torch.zeros(1)], pool=pool)[0].item() == 1
    pool.close()
    branches = ParallelBranches([nn.Linear(2, 2), nn.Linear(2, 2)], pool=pool)
    assert next(iter(branches.state_dict())) == "branches.0.weight"
    twin = copy.deepcopy(branches)
    assert twin.pool is not pool and len(twin(torch.randn(1, 2))) == 2
    assert default_branch_pool() is default_branch_pool()


def _nested(depth: int, pool: BranchPool | None) -> Callable[[Tensor], Tensor]:
    """A branch that fans out twice per level, through parallel_map (pool) or plainly (None)."""

    def branch(x: Tensor) -> Tensor:
        if depth == 0:
            return x.sin() * 2
        sub = _nested(depth - 1, pool)
        inner = [x, x * 3]
        outs = parallel_map(sub, inner, pool=pool) if pool is not None else [sub(t) for t in inner]
        return torch.stack(outs).sum(0)

    return branch


def test_nested_use_does_not_deadlock_and_matches_plain() -> None:
    # One worker: a pool that blocked its waiting threads would hang at depth 2.
    xs = [torch.randn(4, dtype=D, requires_grad=True) for _ in range(3)]
    with BranchPool(max_workers=1) as pool:
        _check_equal(
            lambda: (
                lambda: parallel_map(_nested(3, pool), xs, pool=pool),
                lambda: [_nested(3, None)(x) for x in xs],
                xs,
            )
        )


def test_stress_random_branch_counts_and_nesting() -> None:
    rng = random.Random(0)
    w = torch.randn(4, 4, dtype=D, requires_grad=True)
    errors: list[BaseException] = []

    def work(pool: BranchPool) -> None:
        for _ in range(300):
            n = rng.randint(1, 6)
            xs = [torch.randn(2, 4, dtype=D, requires_grad=True) for _ in range(n)]
            nested = rng.random() < 0.3

            def branch(x: Tensor, nested: bool = nested) -> Tensor:
                y = (x @ w).tanh()
                if nested:
                    y = torch.stack(parallel_map(torch.sin, [y, y * 2], pool=pool)).sum(0)
                return y

            outs = parallel_map(branch, xs, pool=pool)
            _loss(outs).backward()
            if any(x.grad is None for x in xs):
                raise AssertionError("missing input gradient")

    def guarded() -> None:
        try:
            with BranchPool(max_workers=2) as pool:
                work(pool)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=guarded, daemon=True)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "parallel_map stress test deadlocked"
    assert not errors, errors
