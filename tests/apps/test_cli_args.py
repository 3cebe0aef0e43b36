"""Flags derived from a dataclass's fields: name, type, default, help and section come from
the field; ``zeropipe train``'s flags are :class:`TrainConfig`'s, and its rules refuse each
flag that cannot work."""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from zeropipe.apps.cli import build_parser
from zeropipe.apps.cli_args import add_dataclass_arguments, flag, flag_fields, flag_name
from zeropipe.apps.train.config import RULES, TrainConfig
from zeropipe.core.errors import ZeropipeError


@dataclass
class _Settings:
    steps: int = field(default=300, metadata=flag("steps (default {default})", group="run"))
    lr: float = field(default=0.5, metadata=flag("rate (default {default:g})", group="optim"))
    out_dir: str | None = field(
        default=None, metadata=flag("where to write", group="run", metavar="DIR")
    )
    quiet: bool = field(default=False, metadata=flag("say less", group="run"))
    color: bool = field(default=True, metadata=flag("colour (default on)", group="run"))
    hidden: int = 7  # no metadata: not a flag


def _parser(config_type: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="x")
    add_dataclass_arguments(parser, config_type)
    return parser


def test_flag_fields_become_flags_of_their_type_and_default() -> None:
    parser = _parser(_Settings)
    assert [f.name for f in flag_fields(_Settings)] == ["steps", "lr", "out_dir", "quiet", "color"]
    assert _Settings(**vars(parser.parse_args([]))) == _Settings()
    args = parser.parse_args(
        ["--steps", "3", "--lr", "2", "--out-dir", "o", "--quiet", "--no-color"]
    )
    assert vars(args) == {"steps": 3, "lr": 2.0, "out_dir": "o", "quiet": True, "color": False}
    assert isinstance(args.lr, float)
    with pytest.raises(SystemExit):  # not an integer: a usage error, as argparse gives
        parser.parse_args(["--steps", "many"])
    with pytest.raises(SystemExit):  # no metadata, no flag
        parser.parse_args(["--hidden", "1"])


def test_help_states_the_fields_default_in_the_groups_sections() -> None:
    text = " ".join(_parser(_Settings).format_help().split("options:")[1].split())
    assert "--steps STEPS steps (default 300)" in text
    assert "--lr LR rate (default 0.5)" in text
    assert "--out-dir DIR where to write" in text
    # Sections in the order their first field comes, each field in its own.
    assert text.index("run:") < text.index("--steps") < text.index("optim:") < text.index("--lr")
    assert text.index("run:") < text.index("--out-dir") < text.index("optim:")


def test_a_field_that_cannot_be_a_flag_is_refused() -> None:
    @dataclass
    class NoDefault:
        steps: int = field(metadata=flag("steps", group="run"))

    @dataclass
    class ListValued:
        sizes: list[int] = field(default_factory=list, metadata=flag("sizes", group="run"))

    with pytest.raises(TypeError, match="steps: a flag's field needs a default"):
        _parser(NoDefault)
    with pytest.raises(TypeError, match="sizes: a flag is a bool, int, float or str"):
        _parser(ListValued)


def _train_actions() -> dict[str, argparse.Action]:
    parser = build_parser(["train"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {a.option_strings[-1]: a for a in sub.choices["train"]._actions}


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_every_train_flag_is_a_train_config_field_with_its_default_in_its_help() -> None:
    actions = _train_actions()
    fields = {flag_name(f.name): f for f in flag_fields(TrainConfig)}
    assert set(actions) == {*fields, "--help", "--config"}
    hints = typing.get_type_hints(TrainConfig)
    for name, f in fields.items():
        action = actions[name]
        assert action.help is not None and action.help.strip(), name
        if f.default is not None and f.default is not False:  # a value the flag defaults to
            # ... told from the field itself, so that the two cannot drift apart
            assert "{default" in f.metadata["help"], name
            assert _shown(f.default) in action.help, (name, action.help)
        kinds = set(typing.get_args(hints[f.name]) or [hints[f.name]]) - {type(None)}
        if kinds <= {int, float}:  # parsed as the field's type: what --config's file gives too
            assert {action.type} == kinds, name


def test_the_train_rules_pass_the_demo_and_each_refuses_its_flag() -> None:
    demo = TrainConfig()
    for rule in RULES:
        rule(demo)  # the built-in demo is a configuration that works
    cases: list[tuple[dict[str, Any], str]] = [
        ({"schedule": "nope"}, "unknown schedule 'nope'"),
        ({"ranks": 0}, "--ranks, --microbatches, --steps and --batch-size must be >= 1"),
        ({"group_w": 0}, "--group-w must be >= 1"),
        ({"dp": 0}, "--dp must be >= 1"),
        ({"clip": 0.0}, "--clip must be > 0"),
        ({"seq": 1}, "--seq must be >= 2"),
        ({"eval_every": -1}, "--eval-every must be >= 0"),
        ({"checkpoint_every": 0}, "--checkpoint-every must be >= 1"),
        ({"timeout": float("inf")}, "--timeout must be a number of seconds > 0"),
        ({"lr": float("nan")}, "--lr must be a finite number >= 0"),
        ({"memory_limit": -1.0}, "--memory-limit must be a number > 0"),
        ({"heads": 0}, "TrainConfig.heads must be >= 1"),
        ({"width": 90}, "--width 90 must be a multiple of the 4 heads; use e.g. --width 88"),
        ({"batch_size": 15, "dp": 2}, "cannot be split evenly among --dp 2"),
        ({"batch_size": 4}, "--batch-size 4 gives 4 sequences, which cannot be cut"),
        ({"device": "meta"}, "--device 'meta' holds no data"),
    ]
    for changes, message in cases:
        refusal = _first_refusal(replace(demo, **changes))
        assert refusal is not None and message in refusal, (changes, refusal)
        assert "\n" not in refusal


def _first_refusal(cfg: TrainConfig) -> str | None:
    """What :meth:`TrainConfig.check` would refuse ``cfg`` with by its flag rules."""
    for rule in RULES:
        try:
            rule(cfg)
        except ZeropipeError as exc:
            return str(exc)
    return None
