"""The Megatron-Core internals the adapter hooks, against each checked release's source (tests/megatron/contract.py).

megatron-core 0.16.1 also runs live (the other tests of this package); 0.17+ need Python >= 3.12
and are checked by their source only, from what contract_versions.json recorded of each release
wheel (``pip download --no-deps megatron-core==X`` then ``python -m tests.megatron.contract WHEEL...``
re-records it). No network here: the installed release is re-read to prove the extractor.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest

from . import contract

RECORDED: dict[str, dict] = json.loads(contract.FIXTURE.read_text())
MOE = "megatron.core.transformer.moe"
RENAMED = f"{MOE}.moe_layer:MoELayer.routed_experts_compute"


def _installed() -> Path:
    return Path(importlib.metadata.distribution("megatron-core").locate_file(""))


def test_the_installed_release_reads_as_recorded():
    """The extractor, run on the live install, gives what the fixture holds for its version."""
    facts = contract.read_release(_installed())
    version = facts.pop("version")
    assert version in RECORDED, f"megatron-core {version} is installed but not recorded; run python -m tests.megatron.contract {_installed()}"
    assert facts == {key: RECORDED[version][key] for key in facts}, (
        f"megatron-core {version} reads otherwise than recorded: re-record with python -m tests.megatron.contract {_installed()} and the wheels")


@pytest.mark.parametrize("version", sorted(RECORDED))
def test_every_hooked_name_is_in_the_release(version):
    found = RECORDED[version]["found"]
    assert set(found) <= set(contract.names()), f"megatron-core {version}: recorded names the contract no longer has; re-record"
    assert contract.missing(found) == [], (
        f"megatron-core {version} lacks what moetrace.adapters.megatron reads (or its record predates these names: "
        f"re-record from the wheel with python -m tests.megatron.contract)")


@pytest.mark.parametrize(("drop", "named"), [
    (RENAMED, [RENAMED]),
    # the metrics tracker exists, so feature detection picks it: its .metrics is needed, the legacy dict does not stand in
    (f"{MOE}.moe_logging:MoEMetricsTracker.metrics", [f"{MOE}.moe_logging:MoEMetricsTracker.metrics"]),
    (f"{MOE}.moe_utils:topk_routing_with_score_function.router_replay", [f"{MOE}.moe_utils:topk_routing_with_score_function.router_replay"]),
])
def test_a_record_without_a_hooked_name_fails_naming_it(drop, named):
    """Negative control of the check: the newest record less one name."""
    newest = RECORDED[max(RECORDED, key=lambda v: [int(p) for p in v.split(".")])]["found"]
    assert drop in newest
    assert contract.missing(name for name in newest if name != drop) == named


def test_a_release_with_a_renamed_method_fails_naming_it(tmp_path):
    """Negative control from source: a copy of the installed release with ``routed_experts_compute`` renamed."""
    site = _installed()
    shutil.copytree(site / "megatron" / "core", tmp_path / "megatron" / "core", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for info in site.glob("megatron_core-*.dist-info"):
        shutil.copytree(info, tmp_path / info.name)
    layer = tmp_path / "megatron/core/transformer/moe/moe_layer.py"
    text = layer.read_text()
    assert text.count("def routed_experts_compute(") == 1
    layer.write_text(text.replace("def routed_experts_compute(", "def experts_compute("))
    assert contract.missing(contract.read_release(tmp_path)["found"]) == [RENAMED]
    assert contract.missing(contract.read_release(site)["found"]) == []
