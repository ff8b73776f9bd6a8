"""Placement library errors name their parameters; `moetrace placement` spells them as its flags."""

from __future__ import annotations

import numpy as np
import pytest
from moetrace.cli.app import app
from typer.testing import CliRunner

from moetrace.placement.backtesting import holdout
from moetrace.placement.checks import PlacementConfig, PlacementError
from moetrace.placement.plan import plan_experts

from ..analysis.helpers import record


def test_the_library_names_parameters_not_flags() -> None:
    with pytest.raises(PlacementError, match="`replicas` >= 8") as caught:
        plan_experts(np.ones((1, 8)), 6, 1, 1, 2)
    assert "--" not in str(caught.value)
    with pytest.raises(PlacementError, match="`fraction` must be a fraction in"):
        holdout(None, 1.5, PlacementConfig(8, 1, 1, 2))  # type: ignore[arg-type]


def test_the_cli_spells_them_as_flags(tmp_path) -> None:
    rng = np.random.default_rng(0)
    trace = record(tmp_path, "per_pass", [rng.integers(0, 8, (16, 2, 2)) for _ in range(8)], num_experts=8)
    result = CliRunner().invoke(app, ["placement", str(trace), "--gpus", "2", "--holdout", "1.5"])
    assert result.exit_code == 2
    assert "--holdout must be a fraction in (0, 1)" in result.stderr and "`" not in result.stderr
