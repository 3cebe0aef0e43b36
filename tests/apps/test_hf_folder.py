"""``--model-path`` and ``zeropipe export`` to a Hugging Face folder (zeropipe.apps.hf_folder).

Tiny Llama, Qwen3 and GPT-2 folders are written here with ``save_pretrained``
(and one Llama sharded into an index): the pipeline's logits equal transformers',
each rank reads only its stages' keys, a trained run exported loads in
``from_pretrained`` with the pipeline's eval loss, and a rank's memory grows by
its stages' bytes, not the model's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from zeropipe.apps import hf_folder  # noqa: E402
from zeropipe.apps.cli import main  # noqa: E402
from zeropipe.core.errors import ZeropipeError  # noqa: E402

KINDS = ("llama", "qwen3", "gpt2")


def _config(kind: str, width: int = 32, layers: int = 4, tied: bool = True) -> Any:
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=100, n_embd=width, n_layer=layers, n_head=4, n_positions=64,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
    return transformers.AutoConfig.for_model(
        kind, vocab_size=100, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=width // 4, max_position_embeddings=64, tie_word_embeddings=tied,
    )  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    made: dict[str, Path] = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(kind)).eval()
        model.save_pretrained(root / kind)
        made[kind] = root / kind
        if kind == "llama":
            model.save_pretrained(root / "sharded", max_shard_size="20KB")
            made["sharded"] = root / "sharded"
            (root / "sharded" / "tokenizer.json").write_text("{}\n")
    return made


def _reference(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()


def _run(stages: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    h = x
    for s in stages:
        h = s.eval()(h)
    return h


@pytest.mark.parametrize("kind", [*KINDS, "sharded"])
def test_logits_equal_transformers(folders: dict[str, Path], kind: str) -> None:
    assert (folders["sharded"] / hf_folder.INDEX).exists()
    stages, model, keys = hf_folder.build_from_folder(folders[kind], 2, [2, 2], [0, 1])
    ref = _reference(folders[kind])
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = _run(stages, x), ref(x).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(keys) == set(ref.state_dict()) & set(hf_folder.weight_map(folders[kind]))
    assert all(p.device.type == "cpu" for p in model.parameters())
    if kind != "gpt2":  # tied: one tensor for the embedding and the head
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("kind", ["llama", "gpt2", "sharded"])
def test_each_rank_reads_only_its_stages(folders: dict[str, Path], kind: str) -> None:
    files = set(hf_folder.weight_map(folders[kind]))
    for rank in (0, 1):
        stages, model, keys = hf_folder.build_from_folder(folders[kind], 2, [2, 2], [rank])
        names = {}
        for name, t in model.state_dict(keep_vars=True).items():
            names.setdefault(id(t), []).append(name)
        mine = {id(t) for _, t in stages[rank].state_dict(keep_vars=True).items()}
        want = {n for i in mine for n in names.get(i, []) if n in files}
        assert set(keys) == want and keys, (rank, keys)
        other = [
            (n, t)
            for n, t in stages[1 - rank].state_dict(keep_vars=True).items()
            if id(t) not in mine
        ]
        assert other and all(t.device.type == "meta" for _, t in other)
        assert all(t.device.type == "cpu" for t in stages[rank].state_dict().values())


def test_rotary_buffers_are_recomputed(folders: dict[str, Path]) -> None:
    stages, _, _ = hf_folder.build_from_folder(folders["qwen3"], 2, [2, 2], [1])
    fresh = _reference(folders["qwen3"])
    torch.testing.assert_close(stages[1].rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)


def test_model_path_flag_errors(folders: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    out = ["--steps", "1", "--out", str(tmp_path)]  # nothing is trained: each is refused
    for extra, needle in (
        (["--model", "llama"], "--model-path and --model are exclusive"),
        (["--model-config", str(folders["llama"] / "config.json")], "are exclusive"),
    ):
        code = main(["train", "--model-path", str(folders["llama"]), *extra, *out])
        assert code == 2 and needle in capsys.readouterr().err
    code = main(["train", "--model-path", str(folders["llama"] / "nowhere"), *out])
    assert code == 2 and "is not a folder" in capsys.readouterr().err
    with pytest.raises(ZeropipeError, match=r"neither model\.safetensors"):
        hf_folder.weight_map(folders["llama"].parent)


@pytest.mark.parametrize("kind", ["llama", "sharded"])
def test_a_torn_or_foreign_safetensors_is_one_line(
    folders: dict[str, Path], tmp_path: Path, capsys: Any, kind: str
) -> None:
    import shutil

    folder = tmp_path / kind
    shutil.copytree(folders[kind], folder)
    victim = sorted(folder.glob("model*.safetensors"))[-1]
    whole = victim.read_bytes()
    out = ["--steps", "1", "--out", str(tmp_path / "run")]  # nothing is trained: refused
    for torn in (whole[:-100], whole[: len(whole) // 2], b"garbage"):  # cut short, foreign
        victim.write_bytes(torn)
        code = main(["train", "--model-path", str(folder), *out])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, err
        assert f"{victim} is not a readable safetensors file (Error while deserializing" in err


def _hf_eval_loss(model: Any, cfg: Any) -> float:
    from zeropipe.apps.train.workload import batch, load_corpus

    corpus = load_corpus(cfg)
    with torch.no_grad():
        losses = [
            model(x, labels=x).loss.item()
            for x, _ in (batch(corpus, cfg, k, "val") for k in range(cfg.eval_batches))
        ]
    return sum(losses) / len(losses)


def test_train_two_ranks_then_export_loads_in_transformers(
    folders: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    from zeropipe.apps.train.config import TrainConfig
    from zeropipe.apps.train.loop import train

    source = folders["sharded"]  # an index, tied weights, tokenizer file
    cfg = TrainConfig(
        model_path=str(source), ranks=2, steps=3, batch_size=8, microbatches=4, seq=16,
        schedule="1f1b", out=str(tmp_path / "run"), quiet=True, lr=1e-2, warmup=1,
    )  # fmt: skip
    summary = train(cfg)
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), str(out), "--shard-size", "30KB"]) == 0
    capsys.readouterr()
    index = json.loads((out / hf_folder.INDEX).read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as HF does
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors" and len(shards) > 1
    exported = _reference(out)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    before = _hf_eval_loss(_reference(source), cfg)
    after = _hf_eval_loss(exported, cfg)
    assert after == pytest.approx(summary["final_eval_loss"], rel=1e-5)
    assert before == pytest.approx(summary["initial_eval_loss"], rel=1e-5)
    assert after != pytest.approx(before, rel=1e-3)  # trained: the export is not the source
    # an existing folder is refused unless --force; a .safetensors OUT keeps the old export
    assert main(["export", str(tmp_path / "run"), str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "run"), str(out), "--force"]) == 0
    assert (out / "model.safetensors").exists() and not (out / hf_folder.INDEX).exists()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "m.safetensors")]) == 0
    assert _reference(out).config.num_hidden_layers == 4


def test_dualpipe_from_a_folder_trains_as_1f1b_does_and_exports_one_model(
    folders: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    # dualpipe's two copies of every stage run one set of weights: the run learns what
    # 1f1b's does, and the export holds the model once, scoring the run's eval loss.
    from zeropipe.apps.train.config import TrainConfig
    from zeropipe.apps.train.loop import train

    runs = {}
    for schedule in ("1f1b", "dualpipe"):
        cfg = TrainConfig(
            model_path=str(folders["sharded"]), ranks=2, steps=3, batch_size=8, microbatches=4,
            seq=16, schedule=schedule, out=str(tmp_path / schedule), quiet=True, lr=1e-2,
            warmup=1,
        )  # fmt: skip
        runs[schedule] = (cfg, train(cfg))
    (_, plain), (cfg, dual) = runs["1f1b"], runs["dualpipe"]
    assert dual["initial_eval_loss"] == pytest.approx(plain["initial_eval_loss"], rel=1e-6)
    assert dual["final_eval_loss"] == pytest.approx(plain["final_eval_loss"], rel=1e-5)
    assert dual["final_eval_loss"] != pytest.approx(dual["initial_eval_loss"], rel=1e-3)
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "dualpipe"), str(out)]) == 0
    capsys.readouterr()
    assert _hf_eval_loss(_reference(out), cfg) == pytest.approx(dual["final_eval_loss"], rel=1e-5)


@pytest.mark.parametrize("kind", ["qwen3", "gpt2"])
def test_trained_qwen3_and_gpt2_export_with_the_pipeline_eval_loss(
    folders: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    from zeropipe.apps.train.config import TrainConfig
    from zeropipe.apps.train.loop import train

    # One process: what differs by architecture is the names and layout of the tensors the
    # export writes.  The checkpoint written by two ranks together (each its own stages, a
    # tied weight once by the lowest) is the sharded Llama's above; which rank writes a name
    # does not depend on the architecture.
    cfg = TrainConfig(
        model_path=str(folders[kind]), ranks=1, steps=3, batch_size=8, microbatches=4, seq=16,
        schedule="1f1b", out=str(tmp_path / "run"), quiet=True, lr=1e-2, warmup=1,
    )  # fmt: skip
    summary = train(cfg)
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), str(out)]) == 0
    after = _hf_eval_loss(_reference(out), cfg)
    assert after == pytest.approx(summary["final_eval_loss"], rel=1e-5)
    assert after != pytest.approx(_hf_eval_loss(_reference(folders[kind]), cfg), rel=1e-3)


_MEASURE = """
import json, sys, torch
from zeropipe.apps import hf_folder

def rss():
    # Anonymous memory: what the process allocated.  Its resident file pages (shared
    # libraries paged in on first use, a fresh venv's the most) are shared and evictable.
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

torch.set_num_threads(1)
folder, rank = sys.argv[1], int(sys.argv[2])
start = rss()
hf_folder.build_from_folder(folder, 2, [4, 4], [])  # the meta model, cut: nothing loaded
base = rss()
stages, model, keys = hf_folder.build_from_folder(folder, 2, [4, 4], [rank])
grown = rss() - base
mine = {id(t): t for t in stages[rank].state_dict(keep_vars=True).values()}
held = sum(t.numel() * t.element_size() for t in mine.values())
whole = sum(t.numel() * t.element_size() for t in model.state_dict(keep_vars=True).values())
print(json.dumps({"grown": grown, "held": held, "whole": whole, "meta": base - start}))
"""


def test_each_rank_memory_grows_by_its_stages_only(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        _config("llama", width=512, layers=8, tied=False)
    )
    model.save_pretrained(tmp_path / "big", max_shard_size="40MB")
    del model
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _MEASURE, str(tmp_path / "big"), str(rank)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        got = json.loads(out.strip().splitlines()[-1])
        assert got["held"] < 0.6 * got["whole"], got
        assert got["grown"] <= 1.1 * got["held"], got


def test_a_preset_run_exports_its_config(tmp_path: Path, capsys: Any) -> None:
    from zeropipe.apps.train.config import TrainConfig
    from zeropipe.apps.train.loop import train

    cfg = TrainConfig(
        model="gpt2", ranks=1, steps=2, batch_size=8, microbatches=4, seq=16, width=32,
        blocks=2, schedule="1f1b", out=str(tmp_path / "run"), quiet=True,
    )  # fmt: skip
    summary = train(cfg)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    model = _reference(tmp_path / "hf")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert _hf_eval_loss(model, cfg) == pytest.approx(summary["final_eval_loss"], rel=1e-5)
    train_gpt = TrainConfig(
        ranks=1, steps=1, batch_size=8, microbatches=4, seq=16, width=32, blocks=2,
        schedule="1f1b", out=str(tmp_path / "gpt"), quiet=True,
    )  # fmt: skip
    train(train_gpt)
    assert main(["export", str(tmp_path / "gpt"), str(tmp_path / "gpt-hf")]) == 2
    assert "ending in .safetensors" in capsys.readouterr().err
