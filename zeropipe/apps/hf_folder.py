"""Hugging Face folders in and out: ``zeropipe train --model-path DIR`` and ``zeropipe export``.

In (``--model-path DIR``, a folder of ``config.json`` plus ``model.safetensors``,
or ``model.safetensors.index.json`` and its shards):

    resolve_model_path(cfg)        the folder checked, ``cfg.model`` set to its model_type and
                                   ``cfg.model_config`` to its config.json (so the sizing and
                                   checks of --model-config apply to it)
    build_from_folder(folder, ...) the whole model built on the meta device (no rank holds it
                                   all), cut by zeropipe.split, and only the stages this rank
                                   owns materialised from the tensors that are theirs:
                                   ``safe_open`` reads just those keys.  A tied weight is read
                                   once and stays tied; non-persistent buffers (the rotary
                                   embedding's ``inv_freq``) are recomputed on the device.
                                   Other ranks' stages stay on meta; the whole model still
                                   names the checkpoint's keys.

Out (``zeropipe export CHECKPOINT OUT_DIR``): an HF folder that
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads -- ``config.json``,
``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` shards with
``model.safetensors.index.json`` (``--shard-size``, default 2GB), a tied weight
written once under the name HF keeps (the embedding), and the tokenizer the run's
``--data`` was tokenized with (``--tokenizer``), else the tokenizer files of the
``--model-path`` folder when it has them.  The HF config comes from the run's
settings, which every checkpoint's manifest records (``meta.config``): the
``--model-path`` folder's config.json (``--config DIR`` if the folder moved), or the
preset / ``--model-config`` rebuilt from those settings.  The folder is written beside
OUT_DIR and renamed onto it.  Export never writes over what it did not write
(:mod:`zeropipe.apps.export_target`): a run, checkpoints or checkpoint folder is refused,
an existing non-empty OUT_DIR needs ``--force``, which replaces only export's own files
in it.  An OUT ending in ``.safetensors`` keeps the older export: one file of every
state_dict key (an existing file replaced only with ``--force``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeropipe.apps import export_target
from zeropipe.apps.export_target import TOKENIZER_FILES
from zeropipe.apps.hf_experts import disk_name, disk_parts, fused, to_disk
from zeropipe.apps.models.hf_presets import ARCHITECTURES, build_hf
from zeropipe.core.errors import ZeropipeError

__all__ = [
    "INDEX",
    "add_export_arguments",
    "build_from_folder",
    "export_hf_folder",
    "load_stages",
    "read_folder_config",
    "resolve_model_path",
    "run_export",
    "weight_map",
]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


# -- in: --model-path -----------------------------------------------------------------
def resolve_model_path(cfg: Any) -> None:
    """Check ``cfg.model_path`` and set ``cfg.model`` / ``cfg.model_config`` from it (idempotent)."""
    folder = Path(cfg.model_path)
    config_file = str((folder / CONFIG).absolute())
    if getattr(cfg, "_model_path_resolved", None) == config_file:
        return
    if cfg.model_config is not None:
        raise ZeropipeError(
            "--model-path and --model-config are exclusive: the folder's config.json is the "
            "model's config; give one of them"
        )
    kind = _folder_model_type(folder)
    if cfg.model != "gpt":  # run_cli's default when --model is not given
        raise ZeropipeError(
            f"--model-path and --model are exclusive: the folder's config.json names the "
            f"architecture ({kind}); leave --model out"
        )
    weight_map(folder)  # its tensors are there, before any rank starts
    cfg.model, cfg.model_config = kind, config_file
    cfg.model_path = str(folder.absolute())  # as the checkpoint records it, for export
    cfg._model_path_resolved = config_file


def _folder_model_type(folder: Path) -> str:
    if not folder.is_dir():
        raise ZeropipeError(f"--model-path {folder} is not a folder; give a Hugging Face folder")
    try:
        data = json.loads((folder / CONFIG).read_text())
    except OSError as exc:
        raise ZeropipeError(
            f"--model-path {folder}: no readable {CONFIG} ({exc.strerror or exc})"
        ) from None
    except json.JSONDecodeError as exc:
        raise ZeropipeError(f"--model-path {folder}: {CONFIG} is not JSON ({exc})") from None
    kind = data.get("model_type") if isinstance(data, dict) else None
    if kind not in ARCHITECTURES:
        raise ZeropipeError(
            f"--model-path {folder}: model_type {kind!r} is not one of {', '.join(ARCHITECTURES)}"
        )
    return str(kind)


def read_folder_config(folder: str | os.PathLike[str]) -> Any:
    """The transformers config of an HF folder (its config.json)."""
    import transformers

    _folder_model_type(Path(folder))
    return transformers.AutoConfig.from_pretrained(str(folder))


def weight_map(folder: str | os.PathLike[str]) -> dict[str, str]:
    """Tensor name -> the safetensors file of ``folder`` that holds it."""
    folder = Path(folder)
    if (folder / INDEX).exists():
        try:
            index = json.loads((folder / INDEX).read_text())
            found = {str(k): str(v) for k, v in index["weight_map"].items()}
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise ZeropipeError(f"{folder / INDEX} is not a safetensors index ({exc})") from None
        missing = sorted({f for f in found.values() if not (folder / f).exists()})
        if missing:
            raise ZeropipeError(f"{folder / INDEX} names shard(s) {missing} that are not there")
        for shard in sorted(set(found.values())):  # each header read, before any rank starts
            _safetensors_keys(folder / shard)
        return found
    if (folder / SINGLE).exists():
        return {k: SINGLE for k in _safetensors_keys(folder / SINGLE)}
    raise ZeropipeError(
        f"--model-path {folder} has neither {SINGLE} nor {INDEX}; save the model with "
        f"save_pretrained (safetensors)"
    )


def _safetensors_keys(path: Path) -> list[str]:
    """The tensor names in a safetensors file; a torn or foreign file refused in one line.

    Opening reads the header and checks it against the file's length, so a file
    cut short or not safetensors at all is caught here, not as a rank's traceback.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return [str(k) for k in fh.keys()]  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError) as exc:
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ZeropipeError(
            f"{path} is not a readable safetensors file ({why}); copy it again or re-save "
            f"the model with save_pretrained"
        ) from None


def build_from_folder(
    folder: str | os.PathLike[str],
    num_stages: int,
    cut: Sequence[int],
    mine: Iterable[int],
    device: str | torch.device = "cpu",
    seed: int = 0,
    tp_mesh: Any = None,
    checkpoint: bool = False,
) -> tuple[list[nn.Module], nn.Module, list[str]]:
    """The stages of the HF folder's model cut by ``cut`` (decoder layers per stage), the
    whole model, and the keys read: those of the stages ``mine`` only (see the module);
    ``checkpoint``: the model's own gradient checkpointing on."""
    from zeropipe.adapters.split import split

    config = read_folder_config(folder)
    with torch.device("meta"):
        model = build_hf(config, seed, checkpoint=checkpoint)
    stages = split(model, num_stages, balance=list(cut))
    keys = load_stages(model, [stages[s] for s in mine], folder, device)
    if tp_mesh is not None:
        from zeropipe.adapters.tp import parallelize

        parallelize(model, tp_mesh)  # the loaded stages' tensors become their shards
        stages = split(model, num_stages, balance=list(cut))
    return stages, model, keys


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def load_stages(
    model: nn.Module,
    stages: Sequence[nn.Module],
    folder: str | os.PathLike[str],
    device: str | torch.device = "cpu",
) -> list[str]:
    """Materialise on ``device`` the parameters and buffers of ``stages`` (modules of
    ``model`` built on meta) from the safetensors of ``folder``; return the keys read."""
    from safetensors import safe_open

    folder = Path(folder)
    where = weight_map(folder)
    names: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    prefix = getattr(model, "base_model_prefix", "") + "."
    wanted = _unique(
        [p for s in stages for _, p in s.named_parameters(remove_duplicate=False)]
        + [b for s in stages for _, b in s.named_buffers(remove_duplicate=False)]
    )
    plan: dict[str, list[tuple[torch.Tensor, str]]] = {}  # file -> (tensor, key)
    kind = str(getattr(getattr(model, "config", None), "model_type", ""))
    experts: list[tuple[torch.Tensor, list[list[str]]]] = []  # fused, from one per expert
    for t in wanted:
        if t.device.type != "meta":
            continue
        own = names.get(id(t), [])
        key = next((k for k in own if k in where), None)
        if key is None:  # an older save without the base model's prefix (gpt2's "h.0...")
            key = next((k[len(prefix) :] for k in own if k[len(prefix) :] in where), None)
        if key is None:  # a mixture of experts as save_pretrained writes it (hf_experts)
            key = next((disk_name(kind, k) for k in own if disk_name(kind, k) in where), None)
            made_of = [p for k in own if (p := disk_parts(kind, k, t.shape[0])) is not None]
            found = next((p for p in made_of if all(n in where for g in p for n in g)), None)
            if key is None and found is not None:
                experts.append((t, found))
                continue
        if key is None:
            if own and isinstance(t, nn.Parameter):
                raise ZeropipeError(
                    f"{folder} has no tensor {own[0]!r} (nor {', '.join(own[1:]) or 'an alias'}); "
                    f"is it a checkpoint of this config's model?"
                )
            continue  # a non-persistent buffer: recomputed below
        plan.setdefault(where[key], []).append((t, key))
    loaded: dict[int, torch.Tensor] = {}
    read: list[str] = []
    for file, entries in sorted(plan.items()):
        with safe_open(str(folder / file), framework="pt", device="cpu") as fh:
            for t, key in entries:
                value = fh.get_tensor(key)
                if tuple(value.shape) != tuple(t.shape):
                    raise ZeropipeError(
                        f"{folder / file}: {key} is {list(value.shape)}, the model built from "
                        f"{CONFIG} has {list(t.shape)}"
                    )
                # A copy: safetensors' tensor is a private map of the file, which is
                # paged in (and can change under it) until written.
                loaded[id(t)] = value.to(device=device, dtype=t.dtype, copy=True)
                read.append(key)
    for t, parts in experts:
        loaded[id(t)] = _read_experts(folder, where, t, parts).to(device=device, dtype=t.dtype)
        read.extend(n for group in parts for n in group)
    _swap(model, stages, loaded)
    _recompute_buffers(stages, device)
    return sorted(read)


def _read_experts(
    folder: Path, where: dict[str, str], t: torch.Tensor, parts: list[list[str]]
) -> torch.Tensor:
    """The fused experts' parameter ``t`` (on meta) from its per-expert tensors ``parts``."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name in (n for group in parts for n in group):
        by_file.setdefault(where[name], []).append(name)
    got: dict[str, torch.Tensor] = {}
    for file, keys in sorted(by_file.items()):
        with safe_open(str(folder / file), framework="pt", device="cpu") as fh:
            got.update({k: fh.get_tensor(k).clone() for k in keys})
    value = fused([[got[n] for n in group] for group in parts])
    if tuple(value.shape) != tuple(t.shape):
        raise ZeropipeError(
            f"{folder}: the experts {parts[0][0]}... make a tensor of {list(value.shape)}, "
            f"the model built from {CONFIG} has {list(t.shape)}"
        )
    return value


def _swap(model: nn.Module, stages: Sequence[nn.Module], loaded: dict[int, torch.Tensor]) -> None:
    """Put each loaded tensor in every slot that held its meta tensor (a tie stays a tie)."""
    made: dict[int, nn.Parameter] = {}
    modules = {id(m): m for root in (model, *stages) for m in root.modules()}
    for m in modules.values():
        for name, p in list(m._parameters.items()):
            if p is not None and id(p) in loaded:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(loaded[id(p)], requires_grad=p.requires_grad)
                m._parameters[name] = made[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None and id(b) in loaded:
                m._buffers[name] = loaded[id(b)]


def _recompute_buffers(stages: Sequence[nn.Module], device: str | torch.device) -> None:
    """Non-persistent buffers (not in any file) made anew: the rotary embedding's built again
    from its config on ``device``; any other one left on meta is an error."""
    for stage in stages:
        for mname, m in stage.named_modules():
            meta = [n for n, b in m._buffers.items() if b is not None and b.device.type == "meta"]
            if not meta:
                continue
            if "Rotary" in type(m).__name__ and hasattr(m, "config"):
                with torch.device(device):
                    fresh = type(m)(m.config)
                for n in meta:
                    m._buffers[n] = fresh._buffers[n]
                continue
            raise ZeropipeError(
                f"{type(m).__name__} {mname or '(stage)'} has buffer(s) {meta} that are in no "
                f"file and that zeropipe cannot recompute"
            )


# -- out: zeropipe export ---------------------------------------------------------------
def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    unit = "B" if m is None else (m.group(2) or "B").upper().rstrip("B") or "B"
    scale = {"B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "KI": 2**10, "MI": 2**20, "GI": 2**30}
    size = 0 if m is None else int(float(m.group(1)) * scale[unit])
    if size < 1:  # 0.0000001 too: less than a byte
        raise ZeropipeError(f"--shard-size {text!r}: give bytes, e.g. 2GB, 500MB or 1000000")
    return size


def add_export_arguments(parser: Any) -> None:
    """The arguments of ``zeropipe export``."""
    parser.add_argument(
        "checkpoint",
        metavar="CHECKPOINT_DIR",
        help="a checkpoint folder (step-NNNNNN), a checkpoints folder (its 'latest' is read) "
        "or a 'zeropipe train' --out folder",
    )
    parser.add_argument(
        "out",
        metavar="OUT_DIR",
        help="the Hugging Face folder to write (from_pretrained loads it); a name ending in "
        ".safetensors writes one file of the model's state_dict instead",
    )
    parser.add_argument(
        "--shard-size",
        default=None,
        help="largest safetensors shard of an OUT_DIR (default 2GB); more tensors than that: "
        "model-0000k-of-0000N.safetensors and model.safetensors.index.json",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace export's own files (config.json, model*.safetensors, tokenizer files) "
        "in an existing OUT_DIR, keeping the rest, or an existing .safetensors file; a run or "
        "checkpoint folder is refused even so",
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="DIR",
        help="the folder whose config.json (and tokenizer files) to use, if the run's "
        "--model-path folder has moved",
    )


def run_export(args: Any) -> int:
    """``zeropipe export``: an HF folder, or one safetensors file for an OUT ending so."""
    from zeropipe.apps.train import state as train_state

    out = Path(args.out)
    shard_bytes = _size("2GB" if args.shard_size is None else args.shard_size)
    single = out.suffix == ".safetensors"
    if single and args.shard_size is not None:
        raise ZeropipeError(
            "--shard-size splits a folder OUT_DIR's safetensors; a .safetensors OUT is one "
            "file: leave --shard-size out, or name a folder to write a sharded one"
        )
    notes: list[str] = []
    source = train_state.checkpoint_folder(Path(args.checkpoint), notes.append)
    for why in notes:
        print(
            f"zeropipe export: {why}; exporting {source.name}, the newest complete checkpoint",
            file=sys.stderr,
        )
    if single:
        folder, count = train_state.export_safetensors(source, out, args.force)
        print(f"wrote {out}: {count} tensors from {folder}")
        return 0
    folder, files = export_hf_folder(
        source, out, shard_bytes=shard_bytes, force=args.force, config_dir=args.config
    )
    print(f"wrote {out}: {', '.join(files)} from {folder}")
    return 0


def _hf_config_of_run(settings: dict[str, Any], config_dir: str | None) -> tuple[Any, Path | None]:
    """The transformers config the run trained, and the folder it came from (if any)."""
    source = config_dir or settings.get("model_path")
    if source is not None:
        return read_folder_config(source), Path(source)
    if settings.get("model", "gpt") == "gpt":
        raise ZeropipeError(
            "this checkpoint is of --model gpt, which is no Hugging Face model; export it to a "
            "file ending in .safetensors"
        )
    from zeropipe.apps.data.tokens import data_vocab
    from zeropipe.apps.models.hf_presets import hf_config

    try:  # as zeropipe.apps.train.workload sizes it
        vocab = data_vocab(settings.get("data"), settings.get("tokenizer"), settings["seed"])
        config = hf_config(
            settings["model"],
            vocab=vocab,
            width=settings["width"],
            blocks=settings["blocks"],
            heads=settings["heads"],
            seq=settings["seq"],
            dropout=settings["dropout"],
            config_file=settings.get("model_config"),
        )
    except KeyError as exc:
        raise ZeropipeError(
            f"the checkpoint's settings lack {exc}; give --config a folder with the config.json"
        ) from None
    return config, None


def _hf_state(config: Any, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> dict:
    """The checkpoint's tensors under the names HF saves: a tied group once, under the name
    the model's ``named_parameters`` gives it first (the embedding); a mixture's experts one
    tensor per expert (:func:`zeropipe.apps.hf_experts.to_disk`)."""
    with torch.device("meta"):
        model = build_hf(config, 0)
    full = dict(tensors)
    for alias, name in aliases.items():
        full[alias] = tensors[name]
    keep: dict[str, torch.Tensor] = dict(model.named_parameters())
    keep.update({k: b for k, b in model.named_buffers() if k in model.state_dict()})
    missing = sorted(set(keep) - set(full))
    if missing:
        raise ZeropipeError(
            f"the checkpoint lacks {missing[:4]} of the model its config builds; "
            f"give --config the folder it was trained from"
        )
    return to_disk(str(config.model_type), {k: full[k].contiguous() for k in keep})


def export_hf_folder(
    source: Path,
    out: Path,
    shard_bytes: int = 2 * 10**9,
    force: bool = False,
    config_dir: str | None = None,
) -> tuple[Path, list[str]]:
    """Write the model of checkpoint ``source`` as an HF folder ``out`` (see the module);
    return the checkpoint folder read and the files written."""
    from safetensors.torch import save_file

    from zeropipe.apps.train import state as train_state
    from zeropipe.runtime.checkpoint.dcp import consolidated_state_dict

    folder = train_state.checkpoint_folder(source)
    export_target.check_target(out, folder, force, folder_form=True)
    try:
        manifest = json.loads((folder / train_state.MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ZeropipeError(f"{folder / train_state.MANIFEST} cannot be read ({exc})") from None
    settings = dict(manifest.get("meta", {}).get("config") or {})
    config, config_from = _hf_config_of_run(settings, config_dir)
    tensors, aliases = consolidated_state_dict(folder)
    state = _hf_state(config, tensors, aliases)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += n
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config.save_pretrained(str(tmp))
        names = (
            [SINGLE]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        for name, shard in zip(names, shards, strict=True):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
        if len(shards) > 1:
            index = {
                "metadata": {
                    "total_size": sum(t.numel() * t.element_size() for t in state.values())
                },
                "weight_map": {k: n for n, s in zip(names, shards, strict=True) for k in s},
            }
            (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        if settings.get("tokenizer") and settings.get("data"):  # the one the run trained with
            from zeropipe.apps.data.tokenizer import TextTokenizer

            TextTokenizer.load(settings["tokenizer"]).save(tmp)
        else:
            for extra in TOKENIZER_FILES:
                if config_from is not None and (config_from / extra).is_file():
                    shutil.copy2(config_from / extra, tmp / extra)
        for p in tmp.iterdir():  # safetensors writes 0600; a folder to share reads as others do
            os.chmod(p, 0o644)
        export_target.install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, sorted(p.name for p in out.iterdir())
