"""Split backward (I then W) against plain autograd, parameter by parameter.

Every comparison runs the same float64 model twice from identical weights
and identical dropout seeds: once unprepared with ``Tensor.backward`` (the
reference), once prepared with ``input_backward`` + ``weight_backward``.
"""

from __future__ import annotations

import copy
import pickle
import warnings
import weakref
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from zeropipe.autograd.split_backward import (
    WeightGradStash,
    prepare_split,
    split_linears,
    unprepare_split,
    weight_backward_together,
)
from zeropipe.core.errors import PipelineError

M = TypeVar("M", bound=nn.Module)
TOL = 1e-12
B, S, D, V = 2, 3, 8, 13


class Block(nn.Module):
    """Pre-norm MLP block with a residual: LayerNorm, Linear, GELU, Dropout, Linear."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.25)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.fc2(self.drop(self.act(self.fc1(self.ln(h)))))


class Stage(nn.Module):
    """A middle pipeline stage: float activations in, float activations out."""

    def __init__(self, d: int = D, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(blocks)))

    def forward(self, h: Tensor) -> Tensor:
        return self.blocks(h)


class TiedLM(nn.Module):
    """Token ids -> tied embedding -> blocks -> LayerNorm -> head (head.weight is emb.weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.Sequential(Block(D), Block(D))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.ln(self.blocks(self.emb(ids))))


def _pair(make: Callable[[], M]) -> tuple[M, M]:
    torch.manual_seed(0)
    ref = make().double()
    got = copy.deepcopy(ref)
    assert prepare_split(got) is got
    return ref, got


def _block(model: Stage | TiedLM, i: int) -> Block:
    block = model.blocks[i]
    assert isinstance(block, Block)
    return block


def _full(model: nn.Module, x: Tensor, g: Tensor, seed: int = 1) -> Tensor:
    torch.manual_seed(seed)
    out = model(x)
    out.backward(g)
    return out


def _split(model: nn.Module, x: Tensor, g: Tensor, stash: WeightGradStash, seed: int = 1) -> Tensor:
    torch.manual_seed(seed)
    with stash.recording(model):
        out = model(x)
    stash.input_backward(out, g)
    stash.weight_backward()
    return out


def _assert_same_grads(ref: nn.Module, got: nn.Module) -> None:
    pairs = list(zip(ref.named_parameters(), got.parameters(), strict=True))
    for (name, a), b in pairs:
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None and b.grad is not None:
            assert b.grad.dtype == a.dtype, name
            diff = (a.grad - b.grad).abs().max().item()
            assert diff <= TOL, f"{name}: max abs diff {diff}"


def _stage_input() -> tuple[Tensor, Tensor]:
    x = torch.randn(B, S, D, dtype=torch.float64)
    return x.clone().requires_grad_(), x.clone().requires_grad_()


def test_tied_language_model_split_equals_full_backward() -> None:
    ref, got = _pair(TiedLM)
    ids = torch.randint(0, V, (B, S))
    g = torch.randn(B, S, V, dtype=torch.float64)
    out_ref = _full(ref, ids, g)
    stash = WeightGradStash(stage=0, microbatch=0)
    torch.manual_seed(1)
    with stash.recording(got):
        out = got(ids)
    stash.input_backward(out, g)
    # Deferred: every prepared linear weight is untouched by I, the embedding part of the
    # tied weight and the LayerNorm parameters are already there.
    assert _block(got, 0).fc1.weight.grad is None
    assert _block(got, 1).fc2.weight.grad is None
    assert _block(got, 0).fc1.bias.grad is not None
    assert got.emb.weight.grad is not None
    emb_only = got.emb.weight.grad.clone()
    stash.weight_backward()
    assert not torch.equal(got.emb.weight.grad, emb_only)  # the head's share arrived in W
    assert (out - out_ref).abs().max().item() == 0.0
    _assert_same_grads(ref, got)


def test_middle_stage_input_and_weight_grads_equal_full_backward() -> None:
    ref, got = _pair(Stage)
    x_ref, x = _stage_input()
    g = torch.randn(B, S, D, dtype=torch.float64)
    _full(ref, x_ref, g)
    _split(got, x, g, WeightGradStash())
    assert x.grad is not None and x_ref.grad is not None
    assert (x.grad - x_ref.grad).abs().max().item() <= TOL
    _assert_same_grads(ref, got)


def test_recorded_graph_with_plain_backward_is_a_full_backward() -> None:
    ref, got = _pair(Stage)
    x_ref, x = _stage_input()
    g = torch.randn(B, S, D, dtype=torch.float64)
    _full(ref, x_ref, g)
    stash = WeightGradStash()
    torch.manual_seed(1)
    with stash.recording(got):
        out = got(x)
    torch.autograd.backward(out, g)  # B: the stash is not deferring
    assert len(stash) == 0
    _assert_same_grads(ref, got)


@pytest.mark.parametrize("fuse", [True, False])
def test_microbatches_accumulate_like_full_backward(fuse: bool) -> None:
    ref, got = _pair(Stage)
    stash = WeightGradStash(stage=1, fuse_accumulation=fuse)
    for mb in range(3):
        x_ref, x = _stage_input()
        g = torch.randn(B, S, D, dtype=torch.float64)
        _full(ref, x_ref, g, seed=mb)
        stash.microbatch = mb
        _split(got, x, g, stash, seed=mb)
    _assert_same_grads(ref, got)
    if not fuse:
        # Unfused W repeats autograd's arithmetic: not just close, identical.
        for (name, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), name  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [Stage, TiedLM])
def test_weights_of_several_microbatches_together_equal_full_backward(
    make: Callable[[], nn.Module],
) -> None:
    ref, got = _pair(make)
    stashes = []
    for mb in range(3):
        x = torch.randint(0, V, (B, S)) if make is TiedLM else torch.randn(B, S, D).double()
        g = torch.randn(B, S, V if make is TiedLM else D, dtype=torch.float64)
        _full(ref, x, g, seed=mb)
        stash = WeightGradStash(stage=0, microbatch=mb)
        torch.manual_seed(mb)
        with stash.recording(got):
            out = got(x)
        stash.input_backward(out, g)
        stashes.append(stash)
    assert isinstance(got, Stage | TiedLM)
    assert _block(got, 0).fc1.weight.grad is None  # deferred until W
    weight_backward_together(stashes)
    _assert_same_grads(ref, got)
    assert all(len(st) == 0 for st in stashes)
    with pytest.raises(PipelineError, match="ran twice"):
        weight_backward_together(stashes[:1])


def test_weights_together_check_every_stash_before_consuming_any() -> None:
    _, got = _pair(Stage)
    ready = WeightGradStash(microbatch=0)
    with ready.recording(got):
        out = got(torch.randn(B, S, D, dtype=torch.float64))
    ready.input_backward(out, torch.ones_like(out))
    with pytest.raises(PipelineError, match="W before I"):
        weight_backward_together([ready, WeightGradStash(microbatch=1)])
    assert len(ready) > 0  # nothing was consumed: it can still run
    weight_backward_together([ready])
    assert len(ready) == 0


def test_nbytes_is_exactly_the_deferred_inputs_and_output_grads() -> None:
    _, got = _pair(Stage)
    _, x = _stage_input()
    shapes: list[tuple[int, int]] = []
    for m in got.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(
                lambda mod, args, out: shapes.append((args[0].numel(), out.numel()))
            )
    stash = WeightGradStash()
    with stash.recording(got):
        out = got(x)
    assert stash.nbytes == 0 and len(stash) == 0
    stash.input_backward(out, torch.randn_like(out))
    assert len(stash) == len(shapes) == 4
    assert stash.nbytes == sum(8 * (n_in + n_out) for n_in, n_out in shapes)
    stash.weight_backward()
    assert stash.nbytes == 0 and len(stash) == 0


class _Box:
    """What a saved-tensors pack hook hands autograd: alive exactly while the graph holds it."""

    def __init__(self, t: Tensor) -> None:
        self.t = t


def test_autograd_releases_every_saved_tensor_in_input_backward() -> None:
    _, got = _pair(Stage)
    _, x = _stage_input()
    boxes: list[weakref.ref[_Box]] = []

    def pack(t: Tensor) -> _Box:
        box = _Box(t)
        boxes.append(weakref.ref(box))
        return box

    stash = WeightGradStash()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.t), stash.recording(got):
        out = got(x)
    assert sum(r() is not None for r in boxes) == len(boxes) > 8
    stash.input_backward(out, torch.randn_like(out))
    assert sum(r() is not None for r in boxes) == 0


def test_only_linear_inputs_survive_input_backward() -> None:
    _, got = _pair(Stage)
    _, x = _stage_input()
    # Weak references to the tensors each kind of module receives.
    seen: dict[type, list[weakref.ref[Tensor]]] = {nn.Linear: [], nn.GELU: [], nn.LayerNorm: []}
    for m in got.modules():
        for kind, refs in seen.items():
            if isinstance(m, kind):
                m.register_forward_pre_hook(
                    lambda mod, args, refs=refs: refs.append(weakref.ref(args[0]))
                )

    def alive(kind: type) -> int:
        return sum(r() is not None for r in seen[kind])

    stash = WeightGradStash()
    with stash.recording(got):
        out = got(x)
    assert (alive(nn.GELU), alive(nn.LayerNorm), alive(nn.Linear)) == (2, 2, 4)
    stash.input_backward(out, torch.randn_like(out))
    assert alive(nn.GELU) == 0  # saved by GELU only: freed with the graph
    assert alive(nn.LayerNorm) == 1  # block 1's input freed; the stage input is held by the test
    assert alive(nn.Linear) == 4  # what W needs, held by the stash
    stash.weight_backward()
    assert alive(nn.Linear) == 0


def test_weight_backward_before_input_backward_raises() -> None:
    _, got = _pair(Stage)
    stash = WeightGradStash(stage=3, microbatch=7)
    with pytest.raises(PipelineError, match="W before I") as info:
        stash.weight_backward()
    assert "stage 3, microbatch 7" in str(info.value)
    with stash.recording(got):
        out = got(_stage_input()[1])
    with pytest.raises(PipelineError, match="W before I"):
        stash.weight_backward()
    stash.input_backward(out, torch.randn_like(out))
    stash.weight_backward()
    with pytest.raises(PipelineError, match="ran twice"):
        stash.weight_backward()


def test_out_of_order_use_raises_and_clear_resets() -> None:
    _, got = _pair(Stage)
    stash = WeightGradStash()
    with stash.recording(got):
        out = got(_stage_input()[1])
    stash.input_backward(out, torch.randn_like(out))
    with pytest.raises(PipelineError, match=r"I .*ran twice"):
        stash.input_backward(out, torch.randn_like(out))
    with (
        pytest.raises(PipelineError, match="W of the previous one is pending"),
        stash.recording(got),
    ):
        pass
    assert len(stash) > 0
    stash.clear()
    assert len(stash) == 0 and stash.nbytes == 0
    with pytest.raises(PipelineError, match="W before I"):
        stash.weight_backward()
    with stash.recording(got):  # reusable after clear
        got(_stage_input()[1])


def test_stage_without_linears_has_nothing_to_defer() -> None:
    ref, got = _pair(lambda: nn.Sequential(nn.LayerNorm(D), nn.GELU()))
    x_ref, x = _stage_input()
    g = torch.randn(B, S, D, dtype=torch.float64)
    _full(ref, x_ref, g)
    stash = WeightGradStash()
    _split(got, x, g, stash)  # W with no entries is a no-op, not an error
    assert len(stash) == 0
    assert x.grad is not None and x_ref.grad is not None
    assert (x.grad - x_ref.grad).abs().max().item() <= TOL
    _assert_same_grads(ref, got)


def test_recording_an_unprepared_module_raises() -> None:
    with pytest.raises(PipelineError, match="prepare_split"), WeightGradStash().recording(Stage()):
        pass


def test_split_linears_finds_the_prepared_linears_once_for_every_recording() -> None:
    model = Stage().double()
    with pytest.raises(PipelineError, match=r"not prepared for split backward \(blocks\.0\."):
        split_linears(model)
    prepare_split(model)
    found = split_linears(model)
    assert found and all(isinstance(m, nn.Linear) for m in found)
    assert len(found) == sum(isinstance(m, nn.Linear) for m in model.modules())
    # Recording with the list found once defers exactly what a fresh lookup defers.
    x = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
    g = torch.randn(B, S, D, dtype=torch.float64)
    counts = []
    for linears in (None, found):
        stash = WeightGradStash()
        with stash.recording(model, linears):
            out = model(x)
        stash.input_backward(out, g)
        counts.append(len(stash))
        stash.weight_backward()
    assert counts[0] == counts[1] == len(found)


def test_small_linears_left_plain_compute_their_weight_gradient_in_i() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 64)).double()
    ref = copy.deepcopy(model)
    big = model[2].weight.numel() * model[2].weight.element_size()  # 2 KiB; the first 128 B
    prepare_split(model, min_weight_bytes=big)
    assert type(model[0]) is nn.Linear and type(model[2]) is nn.Linear  # no class swap
    with pytest.raises(PipelineError, match=r"not prepared for split backward \(0\)"):
        split_linears(model)
    found = split_linears(model, allow_plain=True)
    assert found == (model[2],)
    x = torch.randn(3, 4, dtype=torch.float64)
    g = torch.randn(3, 64, dtype=torch.float64)
    stash = WeightGradStash()
    with stash.recording(model, found):
        out = model(x)
    stash.input_backward(out, g)
    assert len(stash) == 1 and model[0].weight.grad is not None and model[2].weight.grad is None
    stash.weight_backward()
    torch.autograd.backward(ref(x), g)
    _assert_same_grads(ref, model)


def test_frozen_linear_is_not_deferred_and_stays_exact() -> None:
    ref, got = _pair(Stage)
    for model in (ref, got):
        _block(model, 0).fc1.weight.requires_grad_(False)
    x_ref, x = _stage_input()
    g = torch.randn(B, S, D, dtype=torch.float64)
    _full(ref, x_ref, g)
    stash = WeightGradStash()
    torch.manual_seed(1)
    with stash.recording(got):
        out = got(x)
    stash.input_backward(out, g)
    assert len(stash) == 3
    stash.weight_backward()
    assert _block(got, 0).fc1.weight.grad is None
    assert _block(got, 0).fc1.bias.grad is not None
    assert x.grad is not None and x_ref.grad is not None
    assert (x.grad - x_ref.grad).abs().max().item() <= TOL
    _assert_same_grads(ref, got)


class TwiceInSequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class TwiceOnSameInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) + self.lin(x)


class TiedLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.sigmoid(self.a(x)))


@pytest.mark.parametrize("make", [TwiceInSequence, TwiceOnSameInput, TiedLinears])
def test_weight_used_twice_accumulates(make: Callable[[], nn.Module]) -> None:
    ref, got = _pair(make)
    x_ref, x = _stage_input()
    g = torch.randn(B, S, D, dtype=torch.float64)
    _full(ref, x_ref, g)
    stash = WeightGradStash()
    with stash.recording(got):
        out = got(x)
    stash.input_backward(out, g)
    assert len(stash) == 2
    if make is TwiceOnSameInput:
        # Both entries share the input and (through the sum) the output gradient.
        assert stash.nbytes == x.nbytes + g.nbytes
    stash.weight_backward()
    assert x.grad is not None and x_ref.grad is not None
    assert (x.grad - x_ref.grad).abs().max().item() <= TOL
    _assert_same_grads(ref, got)


def test_linear_on_input_without_grad_still_gets_weight_grad() -> None:
    ref, got = _pair(lambda: nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, 3)))
    x = torch.randn(4, D, dtype=torch.float64)  # 2-D, requires no grad: a first stage
    g = torch.randn(4, 3, dtype=torch.float64)
    _full(ref, x, g)
    stash = WeightGradStash()
    _split(got, x, g, stash)
    assert x.grad is None
    _assert_same_grads(ref, got)


class Checkpointed(nn.Module):
    """Square 2-D linears under activation checkpointing: a recompute that saved different
    tensors than the forward would go unnoticed by checkpoint's shape check."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.inner = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))
        self.outer = nn.Linear(D, D)

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return self.outer(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_inside_a_recorded_stage(reentrant: bool) -> None:
    ref, got = _pair(lambda: Checkpointed(reentrant))
    x = torch.randn(5, D, dtype=torch.float64)
    x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(5, D, dtype=torch.float64)
    _full(ref, x_ref, g)
    stash = WeightGradStash()
    with stash.recording(got):
        out = got(x_got)
    stash.input_backward(out, g)
    # Non-reentrant: the original nodes run, so all three are deferred; reentrant: the
    # recomputed inner graph has no stash and its weights get their gradients in I.
    assert len(stash) == (1 if reentrant else 3)
    stash.weight_backward()
    assert x_got.grad is not None and x_ref.grad is not None
    assert (x_got.grad - x_ref.grad).abs().max().item() <= TOL
    _assert_same_grads(ref, got)


def test_prepare_is_idempotent_reversible_and_keeps_state() -> None:
    torch.manual_seed(0)
    model = TiedLM()
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    text = repr(model)
    assert prepare_split(prepare_split(model)) is model
    assert list(model.state_dict()) == keys
    assert [id(p) for p in model.parameters()] == params
    assert repr(model) == text
    assert all(isinstance(m, nn.Linear) for m in (model.head, _block(model, 0).fc1))
    clone = pickle.loads(pickle.dumps(model))
    with WeightGradStash().recording(clone):  # still prepared after a round trip
        pass
    assert unprepare_split(model) is model
    assert type(model.head) is nn.Linear and type(_block(model, 1).fc2) is nn.Linear
    with pytest.raises(PipelineError), WeightGradStash().recording(model):
        pass


def test_autocast_keeps_param_dtype_and_matches_native() -> None:
    torch.manual_seed(0)
    ref = Stage()  # float32 parameters, bfloat16 compute
    got = copy.deepcopy(ref)
    prepare_split(got)
    x = torch.randn(B, S, D)
    x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(B, S, D)
    dtypes: list[torch.dtype] = []
    _block(got, 0).fc1.register_forward_hook(lambda mod, args, out: dtypes.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        out_ref = ref(x_ref)
        torch.manual_seed(1)
        stash = WeightGradStash()
        with stash.recording(got):
            out = got(x_got)
    assert dtypes == [torch.bfloat16]
    assert out.dtype == out_ref.dtype
    out_ref.backward(g)
    stash.input_backward(out, g)
    assert len(stash) == 4
    stash.weight_backward()
    for (name, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert b.grad.dtype == torch.float32, name
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    assert x_got.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x_got.grad, x_ref.grad, rtol=0, atol=0)


def _hook_logs(model: Stage) -> dict[str, list[Tensor]]:
    """Hooks on two weights: fc1's clamps its gradient, fc2's reads .grad once accumulated."""
    log: dict[str, list[Tensor]] = {"clamp": [], "post": []}
    fc1, fc2 = _block(model, 0).fc1, _block(model, 1).fc2

    def clamp(g: Tensor | None) -> Tensor | None:
        assert g is not None, "a weight hook was called without a gradient"
        log["clamp"].append(g.clone())
        return g.clamp(-1e-3, 1e-3)

    fc1.weight.register_hook(clamp)
    fc2.weight.register_post_accumulate_grad_hook(lambda p: log["post"].append(p.grad.clone()))
    return log


def test_hooked_weights_get_their_gradient_through_autograd_per_microbatch() -> None:
    ref, got = _pair(Stage)
    ref_log, got_log = _hook_logs(ref), _hook_logs(got)
    inputs = [torch.randn(B, S, D, dtype=torch.float64) for _ in range(3)]
    grads = [torch.randn(B, S, D, dtype=torch.float64) for _ in range(3)]
    for k, (x, g) in enumerate(zip(inputs, grads, strict=True)):
        _full(ref, x.clone().requires_grad_(), g, seed=k)
    # Three microbatches through I, then one fused W, as a zero-bubble schedule runs them.
    stashes = []
    for k, (x, g) in enumerate(zip(inputs, grads, strict=True)):
        stash = WeightGradStash(stage=0, microbatch=k)
        torch.manual_seed(k)
        with stash.recording(got):
            out = got(x.clone().requires_grad_())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stash.input_backward(out, g)
        # Once per hooked linear, naming it; the two hook-free linears are still deferred.
        named = sorted(str(w.message).split("'")[1] for w in caught)
        assert named == (["blocks.0.fc1", "blocks.1.fc2"] if k == 0 else []), named
        assert len(stash) == 2
        stashes.append(stash)
    weight_backward_together(stashes)
    for key in ("clamp", "post"):
        assert len(got_log[key]) == len(ref_log[key]) == 3, key
        for a, b in zip(got_log[key], ref_log[key], strict=True):
            assert (a - b).abs().max().item() <= TOL, key
    assert max(t.abs().max().item() for t in ref_log["clamp"]) > 1e-3  # the clamp bites
    _assert_same_grads(ref, got)


def test_a_hook_registered_after_the_forward_is_honoured() -> None:
    ref, got = _pair(Stage)
    x_ref, x = _stage_input()
    g = torch.randn(B, S, D, dtype=torch.float64)
    stash = WeightGradStash()
    torch.manual_seed(1)
    with stash.recording(got):
        out = got(x)
    for model in (ref, got):
        _block(model, 1).fc1.weight.register_hook(lambda t: 2 * t)
    _full(ref, x_ref, g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stash.input_backward(out, g)
    stash.weight_backward()
    _assert_same_grads(ref, got)


class MyLinear(nn.Linear):
    """A user's subclass: left as it is by prepare_split."""


def test_prepare_and_unprepare_leave_modules_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), MyLinear(D, D), nn.Linear(D, D)).double()
    own = model[2].forward = lambda x: x  # the user's own forward on the instance is kept
    before = [(type(m), dict(m.__dict__)) for m in model.modules()]
    prepare_split(model)
    assert [type(m) for m in model.modules()] == [t for t, _ in before]
    assert split_linears(model, allow_plain=True) == (model[0],)
    assert model[2].forward is own
    unprepare_split(model)
    after = [(type(m), dict(m.__dict__)) for m in model.modules()]
    assert after == before


def test_a_copied_prepared_linear_is_prepared_with_its_own_weights() -> None:
    torch.manual_seed(0)
    model = prepare_split(nn.Sequential(nn.Linear(D, D), MyLinear(D, D)).double())
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert type(clone[0]) is nn.Linear and split_linears(clone, allow_plain=True) == (clone[0],)
        with torch.no_grad():
            clone[0].weight.zero_()
            clone[0].bias.zero_()
        assert clone[0](torch.ones(2, D, dtype=torch.float64)).abs().max().item() == 0.0
    # A shallow copy shares the original's forward: it counts as not prepared.
    shallow = copy.copy(model[0])
    assert split_linears(shallow, allow_plain=True) == ()
    assert split_linears(prepare_split(shallow)) == (shallow,)
