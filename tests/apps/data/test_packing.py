"""Documents of many lengths fed to a pipeline: packed into rows (``pack_documents``), or cut
by token budget into microbatches each padded only to its own longest row
(``token_budget_microbatches``): every document once, the cut whose largest microbatch is
smallest, and a split Llama's step on them equal to the unsplit model's (and, to the rounding
of its float32 softmax, to each document run alone)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor

import zeropipe
from zeropipe.apps.data.packing import pack_documents, token_budget_microbatches, token_scale
from zeropipe.core.errors import ZeropipeError


def _documents(count: int = 23, seed: int = 0) -> list[Tensor]:
    """Many short documents and a few long ones."""
    g = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(2, 9, (count - 3,), generator=g)] + [31, 24, 17]
    return [torch.randint(1, 64, (n,), generator=g) for n in lengths]


def _rows_of(ids: Tensor, labels: Tensor) -> list[tuple[int, ...]]:
    """Each row's document (its tokens up to the first pad label)."""
    out = []
    for row, lab in zip(ids, labels, strict=True):
        n = int((lab != -100).sum())
        out.append(tuple(row[:n].tolist()))
    return out


def test_token_budget_holds_every_document_once_each_padded_to_its_own_longest() -> None:
    docs = _documents()
    batches = token_budget_microbatches(docs, 4)
    assert len(batches) == 4 and batches.targets is not None
    seen = []
    for ids, labels in zip(batches.inputs, batches.targets, strict=True):
        assert isinstance(ids, Tensor) and ids.shape == labels.shape
        rows = _rows_of(ids, labels)
        assert max(len(r) for r in rows) == ids.shape[1]  # padded only to its own longest
        assert bool((ids[labels == -100] == 0).all())  # pads are the pad id, labelled -100
        seen += rows
    assert sorted(seen) == sorted(tuple(d.tolist()) for d in docs)


@pytest.mark.parametrize(("count", "parts"), [(9, 3), (10, 4), (7, 7), (12, 2)])
def test_the_cut_makes_the_largest_microbatch_smallest(count: int, parts: int) -> None:
    docs = _documents(count, seed=count)
    batches = token_budget_microbatches(docs, parts)
    largest = max(t.numel() for t in batches.inputs if isinstance(t, Tensor))
    # every contiguous cut of the sorted lengths into ``parts`` groups, by brute force
    lengths = sorted((len(d) for d in docs), reverse=True)
    best = min(
        max((b - a) * lengths[a] for a, b in itertools.pairwise((0, *cuts, len(lengths))))
        for cuts in itertools.combinations(range(1, len(lengths)), parts - 1)
    )
    assert largest == best, (largest, best)
    # and far less padding than one batch padded to the longest document
    real = sum(len(d) for d in docs)
    padded = sum(t.numel() for t in batches.inputs if isinstance(t, Tensor))
    assert padded - real < len(docs) * max(lengths) - real


def test_token_scale_prices_each_microbatch_by_its_tokens() -> None:
    from zeropipe.core.costs import CostModel
    from zeropipe.core.schedules import generate
    from zeropipe.core.simulate import simulate

    for positions in (False, True):
        batches = token_budget_microbatches(_documents(), 4, positions=positions)
        scale = token_scale(batches)
        ids = [x["input_ids"] if isinstance(x, dict) else x for x in batches.inputs]
        assert len(scale) == 4 and sum(scale) == pytest.approx(4.0)
        for x, k in zip(ids, scale, strict=True):
            assert k == pytest.approx(x.numel() * 4 / sum(t.numel() for t in ids))
    # a 1-rank step of them takes each microbatch's share of the tokens' time
    costs = CostModel.uniform(1, F=1.0, B=2.0)
    sized = CostModel(costs.stages, microbatch_scale=scale)
    assert simulate(generate("gpipe", 1, 4), sized).makespan == pytest.approx(12.0)


def test_positions_give_a_dict_batch_and_mistakes_are_refused() -> None:
    batches = token_budget_microbatches(_documents(), 3, positions=True)
    first = batches.inputs[0]
    assert isinstance(first, dict) and set(first) == {"input_ids", "position_ids"}
    assert torch.equal(first["position_ids"][0], torch.arange(first["input_ids"].shape[1]))
    with pytest.raises(ZeropipeError, match=r"2 document\(s\) cannot fill 3 microbatches"):
        token_budget_microbatches(_documents()[:2], 3)
    with pytest.raises(ZeropipeError, match=r"document 1 must be a non-empty 1-d tensor"):
        token_budget_microbatches([torch.ones(3), torch.ones(2, 2)], 1)
    with pytest.raises(ZeropipeError, match=r"a document of 31 tokens does not fit rows of 16"):
        pack_documents(_documents(), 16)


def test_packed_rows_hold_every_document_with_its_own_positions() -> None:
    docs = _documents()
    batch, labels = pack_documents(docs, 32)
    ids, pos = batch["input_ids"], batch["position_ids"]
    assert ids.shape[1] == 32 and ids.shape[0] < len(docs)
    found = []
    for r in range(len(ids)):
        starts = [*(pos[r] == 0).nonzero().flatten().tolist(), 32]
        for a, b in itertools.pairwise(starts):
            assert torch.equal(pos[r, a:b], torch.arange(b - a))
            assert labels[r, a] == -100  # nothing predicts a document's first token
            if bool((labels[r, a + 1 : b] != -100).any()) or ids[r, a] != 0:
                found.append(tuple(ids[r, a:b].tolist()))
                assert torch.equal(labels[r, a + 1 : b], ids[r, a + 1 : b])
    assert sorted(found) == sorted(tuple(d.tolist()) for d in docs)


def _loss_and_grads(model: torch.nn.Module, loss: Tensor) -> tuple[float, dict[str, Tensor]]:
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def test_a_split_llama_on_token_budget_microbatches_equals_the_unsplit_model() -> None:
    pytest.importorskip("transformers", reason="the Hugging Face adapter needs transformers")
    from tests.adapters import hf_cases

    model = hf_cases.build("llama", tied=True)
    docs = _documents()
    batches = token_budget_microbatches(docs, 4, positions=True)
    assert batches.targets is not None
    fn = zeropipe.causal_lm_loss
    # The unsplit model on the same microbatches, and on each document alone: the pads
    # (after every counted token, under causal attention) change nothing but the rounding of
    # Llama's eager attention, whose softmax runs in float32 over rows of another length.
    total = sum(fn.count(t) for t in batches.targets)
    assert total == sum(len(d) - 1 for d in docs)
    sums = [
        fn.sum_and_count(model(**x, use_cache=False).logits, t)[0]
        for x, t in zip(batches.inputs, batches.targets, strict=True)
    ]
    ref_loss, ref = _loss_and_grads(model, torch.stack(sums).sum() / total)
    alone = [fn.sum_and_count(model(d[None]).logits, d[None])[0] for d in docs]
    alone_loss, alone_grads = _loss_and_grads(model, torch.stack(alone).sum() / total)
    assert abs(ref_loss - alone_loss) <= 1e-9
    assert max((ref[n] - alone_grads[n]).abs().max().item() for n in ref) <= 1e-7
    schedule = zeropipe.build_schedule("1f1b", ranks=2, microbatches=4)
    pipe = zeropipe.Pipeline(zeropipe.split(model, 2), schedule, loss_fn=fn)
    loss = pipe.step(batches)
    assert abs(loss.item() - ref_loss) <= hf_cases.TOL
    for n, p in model.named_parameters():
        assert p.grad is not None and (p.grad - ref[n]).abs().max().item() <= hf_cases.TOL, n
