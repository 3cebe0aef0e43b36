"""Each private-torch assumption zeropipe.base._compat relies on, checked on the running torch.

When a torch upgrade breaks one of these, the failing test names the
assumption; fix it in _compat and add the version to TORCH_VERSIONS_CHECKED.
"""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from zeropipe.base import _compat


def _node() -> torch.autograd.graph.Node:
    node = (torch.ones(2, requires_grad=True) * 2).grad_fn
    assert node is not None
    return node


def test_running_torch_is_a_checked_version() -> None:
    # Not a hard requirement to run, but CI pins torch 2.13.0: if this fails
    # there, the checked list and the assumptions below need a look.
    assert _compat.torch_version_checked("2.13.0+cpu")
    assert not _compat.torch_version_checked("1.0.0")
    assert isinstance(_compat.torch_version_checked(), bool)


def test_sequence_number_round_trip() -> None:
    node = _node()
    assert _compat.sequence_nr_settable(node)
    _compat.set_sequence_nr(node, 2**60 + 5)
    assert _compat.get_sequence_nr(node) == 2**60 + 5


def test_sequence_number_range_is_checked() -> None:
    node = _node()
    with pytest.raises(ValueError, match="outside"):
        _compat.set_sequence_nr(node, _compat.MAX_SEQUENCE_NR)
    with pytest.raises(ValueError, match="outside"):
        _compat.set_sequence_nr(node, -1)


def test_accumulate_grad_has_the_maximum_number_and_known_name() -> None:
    x = torch.ones(2, requires_grad=True)
    mul = (x * 2).grad_fn
    assert mul is not None
    acc = mul.next_functions[0][0]
    assert acc is not None
    assert acc.name() == _compat.ACCUMULATE_GRAD_NAME
    assert _compat.is_accumulate_grad(acc) and not _compat.is_accumulate_grad(mul)
    assert _compat.get_sequence_nr(acc) == _compat.MAX_SEQUENCE_NR


def test_thread_counter_numbers_the_nodes_a_thread_creates() -> None:
    x = torch.ones(2, requires_grad=True)
    got: dict[str, int] = {}

    def body() -> None:
        lo = _compat.thread_sequence_nr()
        y = (x * 2).sin()
        hi = _compat.thread_sequence_nr()
        assert y.grad_fn is not None
        got["lo"], got["hi"] = lo, hi
        got["nr"] = _compat.get_sequence_nr(y.grad_fn)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert got["hi"] - got["lo"] == 2
    assert got["lo"] <= got["nr"] < got["hi"]


def test_compiled_autograd_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    if "torch._dynamo.compiled_autograd" not in sys.modules:
        assert _compat.compiled_autograd_reason() is None
    fake = types.ModuleType("torch._dynamo.compiled_autograd")
    fake.compiled_autograd_enabled = True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._dynamo.compiled_autograd", fake)
    assert "compiled autograd" in (_compat.compiled_autograd_reason() or "")
    fake.compiled_autograd_enabled = False  # type: ignore[attr-defined]
    config = types.ModuleType("torch._dynamo.config")
    config.compiled_autograd = True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._dynamo.config", config)
    assert "config.compiled_autograd" in (_compat.compiled_autograd_reason() or "")


def test_top_saved_tensors_hooks() -> None:
    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    assert _compat.top_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert _compat.top_saved_tensors_hooks() == (pack, unpack)


def test_storage_use_count_counts_views() -> None:
    t = torch.zeros(4)
    alone = _compat.storage_use_count(t)
    view = t[1:]
    assert _compat.storage_use_count(t) == alone + 1
    del view
    assert _compat.storage_use_count(t) == alone


def test_cpu_has_no_streams() -> None:
    assert not _compat.streams_supported(torch.device("cpu"))
    assert not _compat.streams_supported(torch.device("meta"))


def test_device_string_only_in_compat() -> None:
    # House rule 5, for the modules that use device streams through _compat.
    root = Path(_compat.__file__).parent.parent
    for rel in ("autograd/parallel.py", "autograd/branch_pool.py", "autograd/priority.py"):
        assert "cuda" not in (root / rel).read_text().lower(), rel


def test_fsdp2_internals_for_sharded_stages_exist() -> None:
    # dp_shard=True drives FSDP2 by hand (tests/runtime/replicas/test_data_parallel.py runs it)
    assert _compat.fsdp_missing() == []
    from torch.distributed.fsdp import FSDPModule

    assert callable(FSDPModule._get_fsdp_state)


def test_p2p_posts_take_group_ranks_and_carry_complex_tensors() -> None:
    # Ranks 1 and 2 of 3 exchange a float and a complex tensor over their own group, in the
    # 3-process launch test_distributed.py shares (tests/runtime/three_rank_cases.py).
    from tests.runtime import three_rank_cases

    results = [out["p2p"] for out in three_rank_cases.results()]
    assert results == [[], [True, True], [True, True]]


def test_tensor_grad_hooks_are_seen_and_their_removal_too() -> None:
    t = torch.zeros(2, requires_grad=True)
    assert not _compat.tensor_has_grad_hooks(t)
    handle = t.register_hook(lambda g: g)
    assert _compat.tensor_has_grad_hooks(t)
    handle.remove()
    assert not _compat.tensor_has_grad_hooks(t)
    leaf = torch.zeros(2, requires_grad=True)
    leaf.register_post_accumulate_grad_hook(lambda p: None)
    assert _compat.tensor_has_grad_hooks(leaf)


def test_a_marked_buffer_shows_when_its_last_bytes_are_written() -> None:
    buf = torch.empty(3, dtype=torch.float32)  # 12 bytes: the mark spans the last two floats
    address = _compat.mark_landing(buf)
    assert address == buf.data_ptr() + 4 and not _compat.landed(address)
    buf[:1] = 1.0  # the message's head: not landed yet
    assert not _compat.landed(address)
    buf[2:] = 2.0  # its tail: landed
    assert _compat.landed(address)
    for unmarked in (torch.empty(1, dtype=torch.float32), torch.empty(4, 4).t()[0]):
        assert _compat.mark_landing(unmarked) is None  # under 8 bytes; not contiguous
