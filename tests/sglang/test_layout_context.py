"""The layout read from SGLang's real parallel context (no engine): DP attention's fields as SGLang publishes them.

``sglang_layout`` reads ``runtime_context.get_parallel()``; the layout tests in
tests/adapters use a stand-in. Here SGLang itself publishes the context of each rank of
``--tp-size 2 --dp-size 2 --enable-dp-attention`` (as its scheduler does) and of plain
``--tp-size 2``, so a field SGLang does not publish under the name read cannot pass (it did:
``enable_dp_attention`` is a server argument, not a context field, and read ``False``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from moetrace.adapters.sglang.layout import sglang_layout

from ..engines import environment
from .checkpoint import build_checkpoint
from .engine import CPU_ENV


@pytest.mark.parametrize(("dp_attention", "want"), [
    (True, [(0, "dp", 1, 2), (1, "dp", 1, 2)]),  # each rank its own DP group, the MoE input gathered over both
    (False, [(0, "tp", 2, 2), (0, "tp", 2, 2)]),
])
def test_layout_of_each_rank_from_sglangs_published_context(tmp_path: Path, dp_attention: bool, want: list[tuple]) -> None:
    checkpoint = build_checkpoint(tmp_path / "qwen3_moe")
    with environment(CPU_ENV):
        from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
        from sglang.srt.server_args import ServerArgs

        args = dict(model_path=str(checkpoint), device="cpu", tp_size=2)
        if dp_attention:
            args.update(dp_size=2, enable_dp_attention=True)
        got = []
        try:
            for rank in range(2):
                reset_context()
                publish(ServerArgs(**args), role="test", ranks=SpawnRanks(world_rank=rank))
                layout = sglang_layout(1, 0, all_to_all=False)
                assert (layout.rank, layout.tp_rank) == (rank, rank)
                got.append((layout.dp_rank, layout.attention, layout.attn_tp_size, layout.router_tp_size))
        finally:
            reset_context()
    assert got == want
