"""``RuntimeOptions``: how a :class:`~zeropipe.runtime.pipeline.Pipeline` runs its schedule.

The constructor says what to run (stages, schedule), what to minimise (``loss_fn``) and
where (``mesh``); everything about *how* -- seeding, the compute device, the
point-to-point protocol, sharding over the replicas, timeouts, autocast -- is one
frozen ``RuntimeOptions``, checked when it is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from zeropipe.base.device import check_autocast
from zeropipe.core.errors import PipelineError

__all__ = ["RuntimeOptions", "options_or_default"]


@dataclass(frozen=True)
class RuntimeOptions:
    """How the runtime executes a schedule.

    Only ``autocast`` changes the arithmetic (as autocast does in a model run
    without a pipeline); ``seed`` chooses which random numbers dropout draws.

    Attributes:
        seed: dropout and other randomness are seeded per (seed, step,
            microbatch, layer), identical whatever the schedule or rank count
            for an ``nn.Sequential``, the stages ``zeropipe.split`` returns, and
            hand-made stages that name their layers' indices with
            :func:`zeropipe.runtime.step.stage.seed_layers`; any other hand-made stage
            is seeded per (seed, step, microbatch, stage index): its masks do not
            depend on the schedule, but change with the cut.
        device: where the stages compute; the stages this process runs are moved
            there.  Default: GPU number ``LOCAL_RANK`` on an NCCL process group,
            else where their parameters are (which must then be one device).  A
            device type alone (no index) means index ``LOCAL_RANK`` (0 when unset).
            Needed when weight OFFLOAD/RELOAD keep the parameters on the host.
            Inputs and targets given to ``step`` are moved to it.
        p2p: how boundary tensors cross processes: ``"ordered"`` issues every
            message in one order both ends agree on, in ``batch_isend_irecv``
            groups (:mod:`zeropipe.runtime.transport.ordered`; the only mode NCCL can run);
            ``"tagged"`` matches messages by tag in any order (gloo only,
            :mod:`zeropipe.runtime.transport.tagged`); ``"auto"``: ordered on NCCL,
            tagged on gloo, where it measured faster (docs/benchmarks.md).
        dp_shard: shard the stages this process runs over the mesh's "dp"
            dimension with FSDP2 (``fully_shard``) instead of replicating them:
            their parameters and ``.grad`` become ``DTensor`` shards between steps
            (the optimizer steps the shards), gathered whole at the start of a step
            and reduce-scattered (summed) at each stage's REDUCE_GRAD
            (:mod:`zeropipe.runtime.replicas.fsdp`).  Needs a "dp" dimension of more than
            one rank and one process per pipeline rank; no weight offload.
        input_first: in a full backward B, produce the stage-input gradient
            before parameter-only work (backward priority) and post its send
            from inside the backward.
        keep_grad_memory: W writes a weight gradient whose ``.grad`` is ``None``
            (after ``optimizer.zero_grad()``) into the memory it used last step,
            when nothing else still refers to it, instead of allocating: on a
            CPU a fresh weight-sized allocation is paid again in page faults,
            on the critical path.  The gradient memory then stays allocated
            between steps (``Pipeline.release_grad_memory()`` frees it).
        count_saved: ``"once"`` counts the bytes of saved activations
            (``Pipeline.peak_saved_bytes``) through saved-tensor hooks the first
            time a stage runs a forward on inputs of a given shape and dtype,
            and reuses that count afterwards: the hooks cost a few microseconds
            per saved tensor.  ``"always"`` hooks every forward, for models
            whose saved bytes depend on the data, not only on the shapes.
            Stages whose activations or weights the schedule offloads are always
            hooked.
        timeout: seconds a rank waits for a peer before failing (distributed).
        autocast: ``torch.bfloat16`` runs every stage's forward, its recompute
            and the loss under ``torch.autocast`` (on the compute device's type);
            the backward runs outside it, as torch recommends.  Parameters and
            their ``.grad`` keep their dtype (float32).  ``None``: no autocast.
        overlap: an overlapped pair of the schedule (``(0F3;3B1)``, as ``dualpipev``
            writes them) runs its forward and its backward at the same time, the
            backward on a second thread, so that each one's waits for received
            tensors pass while the other computes
            (:mod:`zeropipe.runtime.step.pairs`); loss and gradients are the same
            as with ``False``, which runs the two one after the other.  A backward
            that recomputes with Hugging Face's gradient checkpointing runs its
            pairs one half after the other by itself; a stage calling
            ``torch.utils.checkpoint`` on its own needs ``False`` when the model
            draws random numbers (dropout): the recompute restores the global
            generator while the forward beside it draws from it.
    """

    seed: int = 0
    device: torch.device | str | None = None
    p2p: Literal["auto", "ordered", "tagged"] = "auto"
    dp_shard: bool = False
    input_first: bool = True
    keep_grad_memory: bool = True
    count_saved: Literal["once", "always"] = "once"
    timeout: float = 300.0
    autocast: torch.dtype | None = None
    overlap: bool = True

    def __post_init__(self) -> None:
        check_autocast(self.autocast)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise PipelineError(f"seed must be an int, got {self.seed!r}")
        if self.p2p not in ("auto", "ordered", "tagged"):
            raise PipelineError(f"p2p must be 'auto', 'ordered' or 'tagged', got {self.p2p!r}")
        if self.count_saved not in ("once", "always"):
            raise PipelineError(f"count_saved must be 'once' or 'always', got {self.count_saved!r}")
        if not isinstance(self.overlap, bool):
            raise PipelineError(f"overlap must be True or False, got {self.overlap!r}")
        if not self.timeout > 0:
            raise PipelineError(f"timeout must be > 0 seconds, got {self.timeout!r}")


def options_or_default(options: object) -> RuntimeOptions:
    """``Pipeline(options=)``: a :class:`RuntimeOptions`, or None for the defaults."""
    if options is None:
        return RuntimeOptions()
    if not isinstance(options, RuntimeOptions):
        raise PipelineError(f"options must be a RuntimeOptions, got {type(options).__name__}")
    return options
