"""Rough edges a new user met: each one now refused in one line naming the fix, or exact.

- a schedule name of several chunks per rank given one rank's stages (zbv on 2 stages);
- a plain ``loss_fn`` that returns a sum over its rows, taken for a mean;
- Ctrl-C while ``zeropipe.launch`` starts its ranks (tracebacks instead of one line).
"""

from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch import nn

import zeropipe
from zeropipe import Pipeline, build_schedule
from zeropipe.core.errors import PipelineError


def _linears(n: int) -> list[nn.Module]:
    return [nn.Linear(4, 4).double() for _ in range(n)]


@pytest.mark.parametrize(("name", "v"), [("zbv", 2), ("dualpipev", 2), ("interleaved-1f1b", 2)])
def test_a_v_schedule_name_on_one_ranks_stages_is_refused_naming_both_meanings(
    name: str, v: int
) -> None:
    with pytest.raises(PipelineError) as err:
        Pipeline(_linears(v), name, F.mse_loss, microbatches=4)
    message = str(err.value)
    assert "\n" not in message
    assert f"{name} holds {v} stages per rank" in message, message
    assert f"{v} stages make 1 rank" in message and f"split into {2 * v} stages" in message
    assert f"zeropipe.build_schedule({name!r}, ranks=1, microbatches=4)" in message, message
    assert ("(a V)" in message) == (name != "interleaved-1f1b")


def test_one_v_rank_said_with_a_built_schedule_and_two_ranks_from_four_stages_still_run() -> None:
    one = Pipeline(_linears(2), build_schedule("zbv", ranks=1, microbatches=4), F.mse_loss)
    assert one.schedule.num_ranks == 1 and one.schedule.num_stages == 2
    two = Pipeline(zeropipe.split(nn.Sequential(*_linears(4)), 4), "zbv", F.mse_loss,
                   microbatches=4)  # fmt: skip
    assert two.schedule.num_ranks == 2
