"""Rank identity in one home: ``moetrace.config.rank_identity`` turns a config, a layout and a process
group, whichever are given, into the rank's :class:`~moetrace.layout.RankLayout`; the dump paths ask it
and nothing else (real gloo ranks for the process groups)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.distributed as dist

from moetrace.config import RecorderConfig, rank_identity
from moetrace.layout import RankLayout
from moetrace.reference import launch

ROOT = Path(__file__).resolve().parents[2]
# The recorder and its rooms: every dump path. None of them may read a process group's rank or size itself.
DUMP_PATHS = [ROOT / "moetrace" / "recorder.py", *sorted((ROOT / "moetrace" / "recording").glob("*.py"))]
GROUP_READS = {"get_rank", "get_world_size", "is_initialized"}


def _config(**fields: object) -> RecorderConfig:
    return RecorderConfig(num_layers=1, num_physical_experts=8, top_k=2, **fields)  # type: ignore[arg-type]


def test_alone_without_a_group_is_rank_0_of_1():
    assert not dist.is_initialized()
    identity = rank_identity()
    assert (identity.rank, identity.world_size, identity.ep_size, identity.source) == (0, 1, 1, "default")


def test_config_gives_its_ep_coordinates():
    identity = rank_identity(_config(ep_size=4, ep_rank=3))
    assert (identity.rank, identity.world_size, identity.ep_size, identity.ep_rank) == (0, 1, 4, 3)


def test_layout_wins_over_the_config_and_the_configs_layout_over_the_default():
    configured = RankLayout.independent(5, 8, source="reference")
    given = RankLayout.tensor_parallel(2, 4, source="vllm")
    assert rank_identity(_config(layout=configured)) is configured
    assert rank_identity(_config(layout=configured), layout=given) is given
    assert rank_identity(layout=given) is given


def _identities(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """On each of 3 gloo ranks: the identity from the default group, from a sub-group of ranks 1 and 2,
    and from a config whose layout says rank 5 of 8 (which holds whatever the group says)."""
    pair = dist.new_group([1, 2])  # collective: every rank creates it
    seen = {"default": rank_identity(), "config": rank_identity(_config(ep_size=2, ep_rank=rank % 2)),
            "layout": rank_identity(_config(layout=RankLayout.independent(5, 8)))}
    if rank in (1, 2):
        seen["pair"] = rank_identity(group=pair)
    # No rank leaves before all are done with the store: rank 0, outside the pair, returns from
    # new_group at once, and its teardown would close the store that ranks 1 and 2 may still be
    # connecting the pair's gloo mesh through ("Connection closed by peer", a failure by chance).
    dist.barrier()
    return {name: (identity.rank, identity.world_size) for name, identity in seen.items()}


@pytest.mark.slow
def test_process_groups_on_gloo_ranks():
    results = launch(_identities, 3, backend="gloo", threads_per_rank=1)
    for rank, seen in enumerate(results):
        assert seen["default"] == (rank, 3)
        assert seen["config"] == (rank, 3)
        assert seen["layout"] == (5, 8)
    # The sub-group's own numbering (negative control: the default group's numbering differs).
    assert [results[1]["pair"], results[2]["pair"]] == [(0, 2), (1, 2)]
    assert results[1]["pair"] != results[1]["default"]


def group_reads(source: str) -> list[str]:
    """Calls in ``source`` that read a process group's rank, size or state (``dist.get_rank()`` ...)."""
    return sorted(node.func.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GROUP_READS)


def test_dump_paths_ask_rank_identity_only():
    offenders = {path.name: group_reads(path.read_text()) for path in DUMP_PATHS}
    assert {name: calls for name, calls in offenders.items() if calls} == {}
    # Negative control: the check sees a rank read written the way the old helpers wrote it.
    assert group_reads("import torch.distributed as dist\nrank = dist.get_rank() if dist.is_initialized() else 0\n") == [
        "get_rank", "is_initialized"]
