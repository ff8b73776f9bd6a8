"""One contract for every engine adapter: ``instrument(target, recorder=None, capturer=None, *, <typed options>, **recorder_options)``.

The signatures are read from the source (no engine needs to be installed): the same three
parameters first, in that order; what differs between engines comes after them as keyword-only
options, each typed and with a default; the rest are :class:`~moetrace.config.RecorderConfig`
fields. An adapter that feeds no capturer refuses one with a reason, before touching the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from moetrace.adapters import AdapterError
from moetrace.adapters import megatron as mt
from moetrace.adapters import sglang as sgl
from moetrace.adapters import vllm as mt_vllm

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("hf", "vllm", "sglang", "megatron")


def instrument_arguments(engine: str) -> ast.arguments:
    """The parameters of ``adapters/<engine>/__init__.py``'s module-level ``instrument``."""
    tree = ast.parse((ROOT / "adapters" / engine / "__init__.py").read_text())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "instrument"]
    assert len(found) == 1, f"adapters/{engine} defines no module-level instrument()"
    return found[0].args


def is_none(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


@pytest.mark.parametrize("engine", ENGINES)
def test_instrument_takes_target_recorder_capturer_then_typed_options(engine: str) -> None:
    args = instrument_arguments(engine)
    assert not args.posonlyargs and args.vararg is None
    assert [a.arg for a in args.args] == ["target", "recorder", "capturer"]
    defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    assert is_none(defaults[1]) and is_none(defaults[2]), "recorder and capturer default to None"
    if engine == "sglang":  # SGLang in this process: its hooks are module-level, there is nothing to hand over
        assert is_none(defaults[0])
    else:
        assert defaults[0] is None, "the target is required"
    for option, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        assert option.annotation is not None, f"{engine}.instrument option {option.arg!r} has no type"
        assert default is not None, f"{engine}.instrument option {option.arg!r} has no default"
    assert args.kwarg is not None and args.kwarg.arg == "recorder_options"


def test_the_contract_check_can_fail() -> None:
    """Negative control: a signature off the contract (no capturer, as Megatron's was) fails the check."""
    tree = ast.parse("def instrument(target, recorder=None, *, mark_passes: bool = True, **recorder_options): ...")
    args = tree.body[0].args  # type: ignore[attr-defined]
    assert [a.arg for a in args.args] != ["target", "recorder", "capturer"]


@pytest.mark.parametrize(("instrument", "reason"), [
    (lambda: mt.instrument(torch.nn.Linear(2, 2), capturer=object()), "record_routes"),
    (lambda: mt_vllm.instrument(torch.nn.Linear(2, 2), capturer=object()), "enable_return_routed_experts"),
    (lambda: sgl.instrument(capturer=object()), "enable-return-routed-experts"),
], ids=["megatron", "vllm", "sglang"])
def test_an_adapter_that_feeds_no_capturer_refuses_one_with_a_reason(instrument, reason: str) -> None:
    with pytest.raises(AdapterError, match=rf"does not feed a moetrace capturer.*{reason}.*pass capturer=None"):
        instrument()


def test_sglang_takes_no_target() -> None:
    with pytest.raises(AdapterError, match=r"attaches to SGLang in this process.*recorder="):
        sgl.instrument(object())
