"""Backward-pass mechanics usable without a pipeline: split backward, priority, parallel branches."""

from zeropipe.autograd.parallel import (
    BranchError,
    BranchPool,
    ParallelBranches,
    ParallelMapError,
    default_branch_pool,
    parallel_map,
)
from zeropipe.autograd.priority import (
    MAX_PRIORITY_LEVEL,
    BackwardOrder,
    NodeEvent,
    PriorityError,
    PriorityMark,
    PriorityNotAppliedWarning,
    PriorityUnsupportedError,
    check_priority_support,
    predict_backward_order,
    prioritize,
    prioritize_outputs,
    record_backward_order,
)
from zeropipe.autograd.split_backward import WeightGradStash, prepare_split, unprepare_split

__all__ = [
    "MAX_PRIORITY_LEVEL",
    "BackwardOrder",
    "BranchError",
    "BranchPool",
    "NodeEvent",
    "ParallelBranches",
    "ParallelMapError",
    "PriorityError",
    "PriorityMark",
    "PriorityNotAppliedWarning",
    "PriorityUnsupportedError",
    "WeightGradStash",
    "check_priority_support",
    "default_branch_pool",
    "parallel_map",
    "predict_backward_order",
    "prepare_split",
    "prioritize",
    "prioritize_outputs",
    "record_backward_order",
    "unprepare_split",
]
