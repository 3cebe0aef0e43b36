"""The one place where zeropipe touches private or version-dependent torch API.

Checked on torch 2.13.0 (CPU build; the accelerator stream helpers follow the
public ``torch.accelerator`` / ``torch.Stream`` API of that release and were
not run on a GPU).  Every other module imports these helpers instead of
reaching into ``torch._C`` or underscore attributes, so a torch upgrade that
breaks one of them breaks here, visibly, and ``tests/base/test_compat.py`` says
which assumption failed.

What is private, and why zeropipe needs it:

=================================  ===========================================
``Node._sequence_nr()``            the autograd engine's ready queue is a
``Node._set_sequence_nr(n)``       priority queue on this number (PR 114120
                                   made it settable); backward priority is
                                   built on it
``torch.autograd._get_sequence_nr``  the calling thread's next sequence number;
                                   tells which graph nodes a parallel branch
                                   created itself
``torch._dynamo.compiled_autograd``  compiled autograd ignores sequence numbers;
``torch._dynamo.config``           priority must say so instead of silently
                                   doing nothing
``torch._C._autograd.``            the innermost ``saved_tensors_hooks`` pair,
``_top_saved_tensors_default_hooks``  handed to branch threads (the stack is
                                   thread-local)
``distributed_c10d.``              the rendezvous store every rank shares; the
``_get_default_store()``           distributed transport raises a failed
                                   rank's message there so peers stop waiting
``torch._C._storage_Use_Count``    how many tensors share a storage: kept
                                   gradient memory is reused only when no view
                                   of it survives (autograd.grad_memory)
``Node.name()`` ==                 AccumulateGrad has no Python class; its
``"torch::autograd::AccumulateGrad"``  C++ name is how priority and parallel
                                   branches recognise a leaf's gradient sink
``FSDPModule._get_fsdp_state()``   FSDP2's state of a ``fully_shard`` root; the
``FSDPState._lazy_init()``         pipeline runs a sharded stage's gradient
``._state_ctx.all_states``         reduce-scatter at its REDUCE_GRAD action,
``._fsdp_param_groups``            not from autograd hooks: it initialises the
``FSDPParamGroup.post_backward()``  root, reduce-scatters each parameter group
``FSDPState._root_post_backward_`` and finishes the backward the way
``final_callback()``               torch.distributed.pipelining's
                                   ``perform_reduce_grad`` does
``fsdp._fully_shard._fsdp_api.``   the base classes of FSDP2's pluggable
``AllGather``, ``ReduceScatter``   collectives (not exported publicly): the
                                   pipeline posts them itself, so a failed
                                   peer ends the wait within its time limit
``DeviceMesh._flatten()``          a mesh's "dp" and "cp" as one dimension:
                                   FSDP2 shards over dp x cp under context
                                   parallelism (torchtitan does the same)
``DeviceMesh._get_root_mesh()``    the mesh an "ep" mesh was sliced from: FSDP2
                                   shards experts over its dimension of the
                                   replicas holding the same experts
``OptimizedModule._orig_mod``      the module ``torch.compile(module)`` wraps:
                                   a compiled stage's submodules are named on
                                   it (layer seeding), its forward still runs
                                   compiled
``torch.autograd._profiler_enabled``  whether a profiler records on this thread:
                                   the executor names actions with
                                   ``record_function`` only then (each costs
                                   microseconds when nothing records)
``ProcessGroup.send`` / ``.recv``  public, but the low-level call beneath
                                   ``dist.isend`` / ``dist.irecv`` (a list of
                                   tensors, the peer as a rank of the group):
                                   half the cost of a post, whose checks the
                                   gloo transport has made once already
gloo receives land in the tensor   gloo's point-to-point works report
(``mark_landing``, ``landed``)     completion only through a blocking
                                   ``wait()``; a receive is known to have
                                   landed when the sentinel written into its
                                   buffer's last bytes was overwritten
=================================  ===========================================

Device streams and the choice of a device / collective backend use public
API only, but live here too so that the device string of the one accelerator
that needs special casing appears in this file alone (house rule 5).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.autograd.graph import Node

__all__ = [
    "ACCUMULATE_GRAD_NAME",
    "MAX_SEQUENCE_NR",
    "TORCH_VERSIONS_CHECKED",
    "bind_device",
    "compiled_autograd_reason",
    "current_stream",
    "default_backend",
    "flatten_mesh",
    "fsdp_bounded_comms",
    "fsdp_finish_backward",
    "fsdp_lazy_init",
    "fsdp_missing",
    "fsdp_reduce_scatter",
    "get_sequence_nr",
    "is_accumulate_grad",
    "landed",
    "mark_landing",
    "new_stream",
    "p2p_recv",
    "p2p_send",
    "profiler_active",
    "record_stream",
    "rendezvous_store",
    "root_mesh",
    "sequence_nr_settable",
    "set_sequence_nr",
    "stream_context",
    "streams_supported",
    "thread_sequence_nr",
    "top_saved_tensors_hooks",
    "torch_version_checked",
    "uncompiled",
]

TORCH_VERSIONS_CHECKED: tuple[str, ...] = ("2.13.0",)

# AccumulateGrad (and the engine's graph root) carry UINT64_MAX, so they run
# the moment they are ready; priorities must stay below it.
MAX_SEQUENCE_NR = 2**64 - 1

# ``Node.name()`` of the node that adds a gradient into a leaf's ``.grad``.
ACCUMULATE_GRAD_NAME = "torch::autograd::AccumulateGrad"


def is_accumulate_grad(node: Node) -> bool:
    """Whether ``node`` is the one that adds a gradient into a leaf's ``.grad``.

    AccumulateGrad has no Python class to test against; its C++ name is what
    identifies it (checked on the versions above).
    """
    return node.name() == ACCUMULATE_GRAD_NAME


def torch_version_checked(version: str | None = None) -> bool:
    """Whether ``version`` (default: the running torch) is one this module was checked on."""
    v = (version or torch.__version__).split("+")[0]
    return v in TORCH_VERSIONS_CHECKED


# --- sequence numbers -------------------------------------------------------


def sequence_nr_settable(node: Node) -> bool:
    """Whether this torch lets Python set ``node``'s sequence number (torch >= 2.2)."""
    return callable(getattr(node, "_set_sequence_nr", None))


def get_sequence_nr(node: Node) -> int:
    """The sequence number the engine orders ``node`` by (bigger runs first)."""
    return int(node._sequence_nr())


def set_sequence_nr(node: Node, value: int) -> None:
    """Set ``node``'s sequence number; the caller checked :func:`sequence_nr_settable`."""
    if not 0 <= value < MAX_SEQUENCE_NR:
        # The binding takes a uint64 and would wrap silently; UINT64_MAX is
        # reserved for nodes that must run as soon as ready.
        raise ValueError(f"sequence number {value} outside [0, 2**64 - 1)")
    node._set_sequence_nr(value)  # type: ignore[attr-defined]


def thread_sequence_nr() -> int:
    """The sequence number the next autograd node created on this thread will get.

    The counter is thread-local, so a window ``[before, after)`` taken around
    code on one thread contains exactly the nodes that code created there.
    """
    return int(torch.autograd._get_sequence_nr())


# --- compiled autograd ------------------------------------------------------


def compiled_autograd_reason() -> str | None:
    """Why compiled autograd is (or will be) in charge of backward, or None if it is not.

    Compiled autograd traces the graph and runs it in its own order, ignoring
    sequence numbers.  It can only be on if ``torch._dynamo`` was imported, so
    this never imports it (that takes seconds).
    """
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if ca is not None and getattr(ca, "compiled_autograd_enabled", False):
        return "compiled autograd is enabled (torch._dynamo.compiled_autograd)"
    config = sys.modules.get("torch._dynamo.config")
    if config is not None and getattr(config, "compiled_autograd", False):
        return "torch._dynamo.config.compiled_autograd is True"
    return None


# --- thread-local state handed to worker threads ----------------------------


def top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The innermost active ``saved_tensors_hooks`` (pack, unpack) pair on this thread."""
    fn = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if fn is None:
        return None
    hooks = fn(True)
    return None if hooks is None else (hooks[0], hooks[1])


# --- torch.compile'd modules -----------------------------------------------


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile(module)`` wrapped (itself when it is not a compiled one).

    ``torch.compile`` returns an ``OptimizedModule`` holding the original as its
    ``_orig_mod`` submodule (so its submodules' names gain an ``_orig_mod.``
    prefix), as it has since torch 2.0; run on 2.13.  Never imports ``torch._dynamo``
    (seconds): a module can only have been compiled once it is imported.
    """
    frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled = getattr(frame, "OptimizedModule", None)
    while compiled is not None and isinstance(module, compiled):
        inner = module.__dict__.get("_modules", {}).get("_orig_mod")
        if not isinstance(inner, torch.nn.Module):
            break
        module = inner
    return module


# --- accelerator streams ----------------------------------------------------


def tensor_has_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``register_hook`` or ``register_post_accumulate_grad_hook`` hooks are on ``tensor``.

    Reads the private ``_backward_hooks`` / ``_post_accumulate_grad_hooks`` that
    ``torch/_tensor.py`` sets (None until a first hook, an emptied dict once its
    handle is removed); checked on torch 2.11 and 2.13.
    """
    return bool(
        getattr(tensor, "_backward_hooks", None)
        or getattr(tensor, "_post_accumulate_grad_hooks", None)
    )


def storage_use_count(tensor: torch.Tensor) -> int:
    """References to ``tensor``'s storage (each tensor or view on it holds one)."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


def _old_api(device: torch.device) -> bool:
    # torch < 2.6 has no torch.accelerator; CUDA is then the only device with
    # a stream API worth using.
    return not hasattr(torch, "accelerator") and device.type == "cuda"


def streams_supported(device: torch.device) -> bool:
    """Whether ``device`` runs kernels asynchronously on streams (so branches can overlap)."""
    if device.type in ("cpu", "meta"):
        return False
    if _old_api(device):
        return bool(torch.cuda.is_available())
    accel = getattr(torch, "accelerator", None)
    if accel is None or not accel.is_available():
        return False
    current = accel.current_accelerator()
    return current is not None and current.type == device.type


def current_stream(device: torch.device) -> Any:
    """The calling thread's current stream on ``device``."""
    if _old_api(device):
        return torch.cuda.current_stream(device)
    return torch.accelerator.current_stream(device)


def new_stream(device: torch.device) -> Any:
    """A fresh side stream on ``device``."""
    if _old_api(device):
        return torch.cuda.Stream(device)
    return torch.Stream(device=device)


def stream_context(stream: Any | None) -> AbstractContextManager[Any]:
    """Make ``stream`` current on this thread for the block (no-op for None)."""
    if stream is None:
        return nullcontext()
    if _old_api(stream.device):
        return torch.cuda.stream(stream)
    ctx: AbstractContextManager[Any] = stream
    return ctx


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """Tell the caching allocator that ``tensor`` is used on ``stream``."""
    tensor.record_stream(stream)


# --- torch.distributed ------------------------------------------------------


def rendezvous_store() -> torch.distributed.Store:
    """The store the default process group was initialised with (keys seen by every rank).

    That is the ``store=`` given to ``init_process_group``, or the one its
    ``init_method`` rendezvous made (env://: ``PrefixStore("default_pg", ...)``).
    ``torch.distributed.distributed_c10d._get_default_store`` is private and, on
    torch 2.13.0, returns that store wrapped once more in the group's own
    ``PrefixStore("<group name>/", ...)``, which is peeled off here so that a
    launcher holding the same store can write keys the ranks read.
    """
    from torch.distributed import distributed_c10d

    store = distributed_c10d._get_default_store()
    if isinstance(store, torch.distributed.PrefixStore):
        return store.underlying_store
    return store


def p2p_send(group: Any, tensor: torch.Tensor, peer: int, tag: int) -> Any:
    """Post a send of ``tensor`` to ``peer`` (a rank of ``group``, a process group object).

    What ``dist.isend(tensor, global_rank, group, tag)`` posts, without its
    per-call checks and rank lookups (about 20 of its 45 microseconds on the
    2-vCPU VM): the caller passes a contiguous tensor and a group it belongs
    to.  gloo carries a complex tensor as it is (``tests/base/test_compat.py`` sends one).
    """
    return group.send([tensor], peer, tag)


def p2p_recv(group: Any, tensor: torch.Tensor, peer: int, tag: int) -> Any:
    """Post a receive into ``tensor`` from ``peer`` (see :func:`p2p_send`)."""
    return group.recv([tensor], peer, tag)


# Written into a receive buffer's last 8 bytes before the receive is posted.
_LANDING_MARK = 0x5A5A_C0DE_F00D_A5A5


def mark_landing(tensor: torch.Tensor) -> int | None:
    """Mark ``tensor``, a receive buffer not yet posted, so that :func:`landed` can tell when
    its message has arrived; returns the address to ask, None for a buffer under 8 bytes.

    gloo receives into the tensor's own memory (contiguous, on the CPU), reading a
    message from its connection front to back, and a message flows only once its
    receive is posted (the receiver's notice); so the mark is overwritten only by the
    message's last bytes.  Checked on torch 2.13.0's gloo over TCP.
    """
    size = tensor.numel() * tensor.element_size()
    if size < 8 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    address = tensor.data_ptr() + size - 8
    ctypes.c_uint64.from_address(address).value = _LANDING_MARK
    return address


def landed(address: int) -> bool:
    """Whether the message of a buffer :func:`mark_landing` marked has arrived: its ``wait()``
    then returns at once.  False also when the message's last 8 bytes equal the mark (the
    caller waits as for one that has not arrived)."""
    return ctypes.c_uint64.from_address(address).value != _LANDING_MARK


def bind_device(local_rank: int) -> torch.device:
    """The device a process of a launch should compute on, made current for it.

    An accelerator when one is present (the process takes the one numbered
    ``local_rank`` modulo the count), else the CPU.
    """
    accel = getattr(torch, "accelerator", None)
    if accel is not None:
        if not accel.is_available() or accel.device_count() == 0:
            return torch.device("cpu")
        index = local_rank % accel.device_count()
        accel.set_device_index(index)
        current = accel.current_accelerator()
        return torch.device(current.type, index) if current is not None else torch.device("cpu")
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def abort_group(group: Any | None) -> None:
    """Abort ``group``'s communicators so that no operation of it can hang the process.

    ``distributed_c10d._abort_process_group`` is private (torch 2.11 to 2.13
    have it); without it, or on a backend that cannot abort (gloo, whose
    waits this package bounds itself), nothing is done.
    """
    from torch.distributed import distributed_c10d

    abort = getattr(distributed_c10d, "_abort_process_group", None)
    if abort is None or str(torch.distributed.get_backend(group)) != "nccl":
        return
    # Already aborted, or torn down by the watchdog: nothing is left to hang.
    with contextlib.suppress(Exception):
        abort(group)


def default_backend(device: torch.device) -> str:
    """The collective backend for ``device``: NCCL for CUDA GPUs, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


# --- FSDP2 (torch.distributed.fsdp.fully_shard) ------------------------------
# Checked on torch 2.13.0 only (run here, gloo on CPU): the names live in
# torch/distributed/fsdp/_fully_shard/_fully_shard.py (``_get_fsdp_state``),
# _fsdp_state.py (``_lazy_init``, ``_state_ctx.all_states``,
# ``_fsdp_param_groups``, ``_root_post_backward_final_callback``) and
# _fsdp_param_group.py (``post_backward``); torch.distributed.pipelining's
# ``perform_reduce_grad`` uses the same ones.  Not checked on 2.11 (the GPU
# machine's torch): :func:`fsdp_missing` names whatever a torch lacks, and the
# pipeline refuses ``dp_shard=True`` with that list instead of failing mid-step.

# (class, attribute) pairs the helpers below use; the public setters are listed too
# because they appeared over several releases.
_FSDP_NEEDS = (
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule", "_get_fsdp_state"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule", "unshard"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule", "set_is_last_backward"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule", "set_gradient_divide_factor"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule",
     "set_force_sum_reduction_for_comms"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule",
     "set_reshard_after_backward"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState", "_lazy_init"),
    ("torch.distributed.fsdp._fully_shard._fsdp_state", "FSDPState",
     "_root_post_backward_final_callback"),
    ("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup", "post_backward"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule", "set_custom_all_gather"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule",
     "set_custom_reduce_scatter"),
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "AllGather", "allocate"),
    ("torch.distributed.fsdp._fully_shard._fsdp_api", "ReduceScatter", "allocate"),
)  # fmt: skip


def fsdp_missing() -> list[str]:
    """The FSDP2 names zeropipe's sharded stages need that this torch lacks (empty: none)."""
    import importlib

    missing = []
    for module, cls, attr in _FSDP_NEEDS:
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{cls}")
            continue
        if not hasattr(owner, attr):
            missing.append(f"{cls}.{attr}")
    return missing


def _fsdp_state(module: Any) -> Any:
    return module._get_fsdp_state()


def fsdp_lazy_init(module: Any) -> None:
    """Make ``module`` (a ``fully_shard`` root) ready to unshard and reduce outside its forward.

    FSDP2 does this in the root's first pre-forward; a pipeline stage driven
    explicitly (its container never called) needs it before the first unshard.
    """
    _fsdp_state(module)._lazy_init()


def fsdp_reduce_scatter(module: Any) -> None:
    """Reduce-scatter the gradients of every parameter group under ``module`` now.

    What autograd's post-backward hook would do at the end of a backward with
    gradient sync on: the unsharded parameters' ``.grad`` are reduce-scattered
    into the sharded parameters' ``.grad`` (added to what is there), and the
    group reshards if ``set_reshard_after_backward(True)``.
    """
    for state in _fsdp_state(module)._state_ctx.all_states:
        for group in state._fsdp_param_groups:
            group.post_backward()


def fsdp_finish_backward(module: Any) -> None:
    """The root's end-of-backward callback: wait for the reductions, reset per-step state."""
    _fsdp_state(module)._root_post_backward_final_callback()


def fsdp_bounded_comms(module: Any, run: Callable[[Callable[[], Any], str], None]) -> None:
    """Route ``module``'s all-gather and reduce-scatter through ``run(post, what)``.

    ``post()`` issues the collective asynchronously and returns its work;
    ``run`` waits for it (the pipeline: within its time limit, watching for
    failed peers).  FSDP2 then sees a completed collective (the call returns
    no work to wait on).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    def allocate(size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    # all_gather_single / reduce_scatter_single are FSDP2's own in 2.13, where the
    # *_tensor names (same signatures) warn that they are deprecated; older releases
    # may lack them.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    class _AllGather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return allocate(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
            async_op: bool = False,
        ) -> None:  # fmt: skip
            run(
                lambda: all_gather(output_tensor, input_tensor, group=group, async_op=True),
                "the data-parallel all-gather of sharded parameters",
            )

    class _ReduceScatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return allocate(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
            async_op: bool = False,
        ) -> None:  # fmt: skip
            run(
                lambda: reduce_scatter(
                    output_tensor, input_tensor, op=op, group=group, async_op=True
                ),
                "the data-parallel reduce-scatter of sharded gradients",
            )

    module.set_custom_all_gather(_AllGather())
    module.set_custom_reduce_scatter(_ReduceScatter())


def flatten_mesh(mesh: Any, names: tuple[str, ...]) -> Any | None:
    """``mesh``'s dimensions ``names`` as one 1-D DeviceMesh (``mesh[names]._flatten()``,
    torchtitan's ``dp_shard_cp``), kept by the root mesh, so asking again makes no new group.

    ``DeviceMesh._flatten`` is private; checked on torch 2.13.0 (present since 2.5).  None
    where a torch lacks it: FSDP2 then shards over a mesh made from the group itself, which
    serves stages that are not tensor-parallel.
    """
    sub = mesh[names] if len(names) > 1 else mesh[names[0]]
    flatten = getattr(sub, "_flatten", None)
    return flatten() if callable(flatten) else None


def root_mesh(mesh: Any) -> Any | None:
    """The DeviceMesh ``mesh`` was sliced from (itself if none): ``_get_root_mesh()``,
    private, checked on torch 2.13.0; older releases kept it in ``_mesh_resources``.  None
    where neither exists."""
    get = getattr(mesh, "_get_root_mesh", None)
    if callable(get):
        return get()
    from torch.distributed import device_mesh

    resources = getattr(device_mesh, "_mesh_resources", None)
    get = getattr(resources, "get_root_mesh", None)
    return get(mesh) if callable(get) else None


def profiler_active() -> bool:
    """Whether a torch profiler records on this thread (``torch.profiler.profile`` in an
    active phase of its schedule, ``torch.autograd.profiler.profile``).

    The executor names each action with ``record_function`` only then: entered with no
    profiler running, one costs ~6-17 us (two dispatcher calls), which a step of a few
    hundred actions would pay for nothing.  ``torch.autograd._profiler_enabled`` is private
    (the C++ profiler's thread-local state, which torch's rpc and DataPipes read too; a
    profiler's callbacks are this thread's, so where it says no, a ``record_function`` here
    would record nothing either); checked on torch 2.13.0.  A torch without it gets True:
    every action named, at that cost.
    """
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    return True if enabled is None else bool(enabled())
