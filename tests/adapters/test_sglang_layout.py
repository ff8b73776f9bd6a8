"""SGLang's parallel context -> moetrace's RankLayout (no engine; the live TP and EP layouts are in tests/sglang).

DP attention is not run live here (see docs/integrations/sglang.md); these check the
mapping of SGLang's coordinates, and which rows count, for each layout.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from moetrace.adapters.sglang.layout import sglang_layout

from moetrace.layout import counted_rows


def _parallel(tp_rank: int, tp_size: int = 2, dp_attention: bool = False, attn_tp_size: int = 2) -> SimpleNamespace:
    return SimpleNamespace(tp_size=tp_size, tp_rank=tp_rank, pp_size=1, pp_rank=0, attn_dp_enabled=dp_attention, attn_tp_size=attn_tp_size)


def _counted(layouts) -> list[bool]:
    return counted_rows([x.token_group for x in layouts], [x.rank for x in layouts]).assignments.tolist()


@pytest.mark.parametrize(("dp_attention", "all_to_all", "counted", "attention"), [
    (False, False, [True, False], "tp"),  # TP attention: both ranks route the same tokens
    (True, True, [True, True], "dp"),  # DP attention + DeepEP: each rank routes its own tokens
    (True, False, [True, False], "dp"),  # DP attention, no all-to-all: SGLang gathers the batch before the MoE layer
])
def test_which_sglang_ranks_count(dp_attention, all_to_all, counted, attention):
    layouts = [sglang_layout(2, r, _parallel(r, dp_attention=dp_attention, attn_tp_size=1 if dp_attention else 2), all_to_all=all_to_all) for r in range(2)]
    assert [x.source for x in layouts] == ["sglang", "sglang"]
    assert [(x.rank, x.tp_rank, x.ep_rank, x.attention) for x in layouts] == [(0, 0, 0, attention), (1, 1, 1, attention)]
    assert [x.dp_rank for x in layouts] == ([0, 1] if dp_attention else [0, 0])
    assert _counted(layouts) == counted
