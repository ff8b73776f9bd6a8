"""Device operations per hook (issue 50): at most 3 in every mode (2: ``copy_`` and ``fill_``),
counts and tokens taken once per pass.

A ``TorchDispatchMode`` sees every aten op a hook issues; views (metadata only, no kernel) are
left out. The negative control runs the pre-issue-50 hook body (add, clamp_, scatter_add_, ne,
any, sum, addcmul_) under the same counter, which must see its 7 ops. Counts and tokens, now
taken once per pass from the pass counter's stage, are checked against an independent numpy
count of the ids fed, through the cases the stage must get right: rows mixing -1 and real ids,
rows of invalid ids only, rows all -1, layers given fewer rows than others, micro-batches, a
pass larger than the stage (``stat`` and ``per_pass`` count it directly), and CUDA-graph replay
(graphs of two batch sizes); and the stage views a hook keeps between passes are made again
when its layer's rows change.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetrace import ExpertDistributionRecorder, RecorderConfig
from moetrace.config import MODES
from moetrace.recording.modes import MODE_CLASSES
from moetrace.recording.pass_counter import PassCounter
from moetrace.testing import assert_no_host_sync
from moetrace.trace import open_trace
from tests.recorder.helpers import captured_hooks, numpy_counts

MAX_HOOK_OPS = 3
HOOK_OPS = ["copy_.default", "fill_.Scalar"]
LAYERS, EXPERTS, TOP_K, MAX_TOKENS = 3, 16, 4, 8


class OpCounter(TorchDispatchMode):
    """Every aten op issued inside the block, views left out (they launch no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def make(tmp_path, mode: str, layers: int = LAYERS, max_tokens: int = MAX_TOKENS) -> ExpertDistributionRecorder:
    return ExpertDistributionRecorder(RecorderConfig(
        num_layers=layers, num_physical_experts=EXPERTS, top_k=TOP_K, mode=mode, output_dir=tmp_path, window=8,
        max_tokens_per_pass=max_tokens, stream_chunk_passes=4, stream_chunk_tokens=64, segment_seconds=0,
    ))


def hook_ops(rec: ExpertDistributionRecorder, ids: torch.Tensor) -> list[str]:
    with rec.with_forward_pass(), rec.with_current_layer(0), OpCounter() as counter:
        rec.on_select_experts(ids)
    return counter.ops


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("mode", MODES)
def test_a_hook_issues_at_most_three_device_ops(tmp_path, mode, dtype):
    rec = make(tmp_path, mode)
    rec.start_record()
    ops = hook_ops(rec, torch.tensor([[0, 3, -1, 20], [5, 5, 1, -7]], dtype=dtype))
    assert 0 < len(ops) <= MAX_HOOK_OPS, ops
    assert ops == HOOK_OPS


def naive_hook(current: torch.Tensor, ones: torch.Tensor, ids: torch.Tensor) -> None:
    """The hook body before issue 50: the columns in two ops, the count, and the layer's tokens in four."""
    index = torch.add(ids.reshape(-1), 2)
    index.clamp_(0, EXPERTS + 2)
    current[0].scatter_add_(0, index, ones[: index.shape[0]])
    real = torch.ne(index.view(ids.shape), 1).any(dim=1)
    current[0, -1:].addcmul_(real.sum(dim=0, keepdim=True), ones[:1])


def test_negative_control_the_counter_sees_the_naive_hooks_seven_ops():
    current = torch.zeros((1, EXPERTS + 5), dtype=torch.int64)
    ones = torch.ones(64, dtype=torch.int64)
    with OpCounter() as counter:
        naive_hook(current, ones, torch.tensor([[0, 3, -1, 20], [5, 5, 1, -7]]))
    assert len(counter.ops) == 7 > MAX_HOOK_OPS, counter.ops


@pytest.mark.parametrize("mode", MODES)
def test_pass_end_ops_do_not_grow_with_layers(tmp_path, mode):
    """Counts and tokens are taken once per pass for all layers: the pass end issues as many ops for 2 layers as for 6."""
    ends = []
    for layers in (2, 6):
        rec = make(tmp_path / f"{layers}", mode, layers=layers)
        rec.start_record()
        with OpCounter() as counter:
            with rec.with_forward_pass():
                for layer in range(layers):
                    with rec.with_current_layer(layer):
                        rec.on_select_experts(torch.tensor([[0, 3, -1, 2]]))
        hooks = len(HOOK_OPS) * layers
        ends.append(len(counter.ops) - hooks)
    assert ends[0] == ends[1], ends


def expected_tokens(passes: list[list[np.ndarray]]) -> list[int]:
    """Independent count: per pass, the most rows with an id other than -1 that any layer was given."""
    return [max(int((ids != -1).any(axis=1).sum()) for ids in layers) for layers in passes]


def awkward_passes() -> list[list[np.ndarray]]:
    """Passes whose layers differ: mixed -1 rows, invalid-only rows, all -1 rows, fewer rows in some layers."""
    rng = np.random.default_rng(50)
    passes = []
    for tokens in (5, 8, 3, 1, 7, 8):
        layers = []
        for layer in range(LAYERS):
            rows = max(1, tokens - layer * (tokens % 3))  # some layers get fewer rows
            ids = rng.integers(-8, EXPERTS + 4, (rows, TOP_K))
            ids[rng.random(rows) < 0.3] = -1  # all -1 rows: padding, not tokens
            ids[0, : TOP_K // 2] = -1  # a real row mixing -1 with other ids
            if rows > 1:
                ids[1] = [-5, -1, -1, -1]  # an invalid id and padding: a token
            layers.append(ids)
        passes.append(layers)
    return passes


def run(rec: ExpertDistributionRecorder, passes: list[list[np.ndarray]]) -> None:
    for layers in passes:
        with rec.with_forward_pass():
            for layer, ids in enumerate(layers):
                with rec.with_current_layer(layer):
                    rec.on_select_experts(torch.as_tensor(ids, dtype=torch.int32))


@pytest.mark.parametrize("mode", MODES)
def test_pass_tokens_match_an_independent_count(tmp_path, mode):
    passes = awkward_passes()
    rec = make(tmp_path, mode)
    rec.start_record()
    with assert_no_host_sync():
        run(rec, passes)
    want = expected_tokens(passes)
    assert rec.snapshot().num_tokens == sum(want)
    with open_trace(rec.dump_record(tmp_path / f"{mode}.h5")) as trace:
        if mode == "per_token":  # its trace counts positions: rows of [T, L, k] with any id other than -1 in any layer
            want = [int(np.any([np.pad(ids != -1, ((0, MAX_TOKENS - len(ids)), (0, 0))) for ids in layers], axis=(0, 2)).sum()) for layers in passes]
        assert int(trace.num_tokens().sum()) == sum(want)
        if mode == "per_pass":
            np.testing.assert_array_equal(np.concatenate([c.num_tokens for c in trace.iter_passes(chunk=4)]), want)


def stale_row_passes() -> list[list[np.ndarray]]:
    """A full pass, then one whose first layer gets 2 rows and the others 2 real rows and padding."""
    full = np.arange(MAX_TOKENS * TOP_K).reshape(MAX_TOKENS, TOP_K) % EXPERTS
    padded = np.where(np.arange(MAX_TOKENS)[:, None] < 2, full, -1)
    return [[full] * LAYERS, [full[:2]] + [padded] * (LAYERS - 1)]


def micro_batched_passes() -> list[list[list[np.ndarray]]]:
    """Passes of micro-batches (per layer, the id blocks of its hooks) whose rows change from pass
    to pass: 3 rows, 8, 8 again, micro-batches of 3 and 5, then 1."""
    rng = np.random.default_rng(7)
    return [[[rng.integers(-2, EXPERTS + 2, (rows, TOP_K)) for rows in blocks] for _ in range(LAYERS)]
            for blocks in ((3,), (8,), (8,), (3, 5), (1,))]


def counted_micro_batches(rec: ExpertDistributionRecorder, passes: list[list[list[np.ndarray]]]) -> np.ndarray | None:
    """The passes' micro-batches through the hooks; the physical counts, or ``None`` where torch
    refuses a hook's ``out=`` view of another shape (newer releases; older ones resize it, warning)."""
    rec.start_record()
    try:
        with assert_no_host_sync():
            for layers in passes:
                with rec.with_forward_pass():
                    for layer, blocks in enumerate(layers):
                        with rec.with_current_layer(layer):
                            for ids in blocks:
                                rec.on_select_experts(torch.as_tensor(ids, dtype=torch.int32))
    except RuntimeError:
        return None
    return rec.snapshot().physical_count


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize("views", ["kept-per-rows", "negative-control-kept-per-layer"])
def test_a_hooks_kept_views_follow_its_rows(tmp_path, monkeypatch, views):
    """A hook reuses its layer's stage views while the layer's rows stay the same and makes them
    again when they change: each layer's counts match a numpy count of the ids fed. Views kept
    per layer whatever the rows (the first ones made) miscount."""
    if views != "kept-per-rows":
        first: dict[int, tuple] = {}
        kept = PassCounter._rows_view
        monkeypatch.setattr(PassCounter, "_rows_view", lambda self, layer, start, end: first.setdefault(layer, kept(self, layer, start, end)))
    passes = micro_batched_passes()
    want = np.zeros((LAYERS, EXPERTS), dtype=np.int64)
    for layers in passes:
        for layer, blocks in enumerate(layers):
            for ids in blocks:
                want[layer] += np.bincount(ids[(ids >= 0) & (ids < EXPERTS)], minlength=EXPERTS)
    counted = counted_micro_batches(make(tmp_path, "stat"), passes)
    assert (counted is not None and np.array_equal(counted, want)) is (views == "kept-per-rows")


@pytest.mark.parametrize("set_back", [True, False], ids=["stage-set-back", "negative-control-not-set-back"])
def test_a_pass_never_counts_rows_an_earlier_pass_left(tmp_path, monkeypatch, set_back):
    """Where a later pass gives a layer fewer rows than another layer, the rows an earlier pass
    left there must not count: without setting the stage back, the independent count sees them."""
    if not set_back:
        monkeypatch.setattr(PassCounter, "clear", lambda self: self.current.zero_())
    passes = stale_row_passes()
    rec = make(tmp_path, "stat")
    rec.start_record()
    run(rec, passes)
    assert (rec.snapshot().num_tokens == sum(expected_tokens(passes))) is set_back


@pytest.mark.parametrize("mode", ["stat", "per_pass"])
def test_a_pass_larger_than_the_stage_is_counted_directly(tmp_path, mode):
    """Layers over ``max_tokens_per_pass`` rows (in one call, or after micro-batches) are counted
    without the stage in the counting modes, tokens included, and still exactly."""
    rng = np.random.default_rng(7)
    big = [[rng.integers(-2, EXPERTS + 1, (MAX_TOKENS + 5, TOP_K)) for _ in range(LAYERS)]]
    small = [[rng.integers(-1, EXPERTS, (3, TOP_K)) for _ in range(LAYERS)]]
    rec = make(tmp_path, mode)
    rec.start_record()
    run(rec, big + small)
    with rec.with_forward_pass():  # micro-batches: the second call of each layer no longer fits
        for layer in range(LAYERS):
            with rec.with_current_layer(layer):
                rec.on_select_experts(torch.as_tensor(small[0][layer]))
                rec.on_select_experts(torch.as_tensor(big[0][layer][: MAX_TOKENS - 1]))
    joined = [[np.concatenate([s, b[: MAX_TOKENS - 1]]) for s, b in zip(small[0], big[0], strict=True)]]
    snap = rec.snapshot()
    assert snap.num_tokens == sum(expected_tokens(big + small + joined))
    counts = np.zeros((LAYERS, EXPERTS), np.int64)
    for layers in big + small + joined:
        for layer, ids in enumerate(layers):
            flat = ids.reshape(-1)
            counts[layer] += np.bincount(flat[(flat >= 0) & (flat < EXPERTS)], minlength=EXPERTS)
    np.testing.assert_array_equal(snap.physical_count, counts)


def test_per_token_refuses_a_pass_larger_than_the_stage(tmp_path):
    rec = make(tmp_path, "per_token")
    rec.start_record()
    with pytest.raises(ValueError, match=f"pass of {MAX_TOKENS + 1} tokens exceeds max_tokens_per_pass={MAX_TOKENS}; raise it"):
        run(rec, [[np.zeros((MAX_TOKENS + 1, TOP_K), np.int64)] * LAYERS])


@pytest.mark.parametrize("mode", MODES)
def test_tokens_under_graph_replay_match_an_independent_count(tmp_path, mode):
    """Captured once at the static batch size; each replay's real rows (the rest all -1) counted at pass end."""
    rec = make(tmp_path, mode)
    static = torch.full((LAYERS, MAX_TOKENS, TOP_K), -1, dtype=torch.int64)
    graph = captured_hooks(rec, static)
    rec.start_record()
    passes = []
    for layers in awkward_passes():
        static.fill_(-1)
        for layer, ids in enumerate(layers):
            static[layer, : len(ids)] = torch.as_tensor(ids[:MAX_TOKENS])
        passes.append([static[layer].numpy().copy() for layer in range(LAYERS)])
        with rec.with_forward_pass():
            graph.replay()
    assert rec.snapshot().num_tokens == sum(expected_tokens(passes))


@pytest.mark.parametrize("give_back", [True, False], ids=["unwritten-given-back", "negative-control-kept"])
def test_padding_counts_only_the_ids_given(tmp_path, monkeypatch, give_back):
    """Rows a layer was not given hold -1 in the stage at pass end: a layer given fewer rows than
    another, and every layer under replay of a graph smaller than the largest one captured. Each
    layer's expert counts, invalid ids and padding ids (-1 given) equal a numpy count of the ids
    fed; counting those rows as padding (the negative control) does not."""
    if not give_back:
        monkeypatch.setattr(PassCounter, "_take_back_unwritten", lambda self, rows: None)
    rec = make(tmp_path, "stat")
    graphs = []
    for size in (MAX_TOKENS, 3):
        static = torch.full((LAYERS, size, TOP_K), -1, dtype=torch.int64)
        graphs.append((captured_hooks(rec, static), static))
    rec.start_record()
    passes = awkward_passes()
    with assert_no_host_sync():
        run(rec, passes)
    rng = np.random.default_rng(3)
    for i in range(6):
        graph, static = graphs[i % 2]
        ids = rng.integers(-3, EXPERTS + 2, static.shape)
        ids[:, -1] = -1  # a padding row of the static batch: given, so counted as padding
        static.copy_(torch.as_tensor(ids))
        with rec.with_forward_pass(), assert_no_host_sync():
            graph.replay()
        passes.append(list(ids))
    counts, invalid = numpy_counts(passes, EXPERTS)
    padding = np.sum([[(ids == -1).sum() for ids in layers] for layers in passes], axis=0)
    with open_trace(rec.dump_record(tmp_path / "padding.h5")) as trace:
        np.testing.assert_array_equal(trace.physical_count(), counts)
        np.testing.assert_array_equal(trace.invalid_ids()[0], invalid)
        assert np.array_equal(trace.padding_ids()[0], padding) is give_back


@pytest.mark.parametrize("forget", [True, False], ids=["forgotten", "negative-control-kept"])
def test_a_replay_in_a_pass_begun_before_start_record_is_not_counted(tmp_path, monkeypatch, forget):
    """``start_record`` (another thread) lands inside a pass whose graph then replays: that pass is
    not recorded, and the rows it staged must not count in the next pass, whose smaller graph
    leaves them in place."""
    if not forget:
        monkeypatch.setattr(ExpertDistributionRecorder, "_discard_pass", lambda self: None)
    rec = make(tmp_path, "stat")
    (big, big_ids), (small, small_ids) = [(captured_hooks(rec, s), s) for s in (torch.zeros((LAYERS, n, TOP_K), dtype=torch.int64) for n in (MAX_TOKENS, 2))]
    big_ids.fill_(5)
    small_ids.fill_(7)
    with rec.with_forward_pass():
        rec.start_record()
        big.replay()
    with rec.with_forward_pass():
        small.replay()
    want = np.zeros((LAYERS, EXPERTS), np.int64)
    want[:, 7] = 2 * TOP_K
    snap = rec.snapshot()
    assert (np.array_equal(snap.physical_count, want) and snap.num_tokens == 2) is forget


def test_every_configured_mode_has_its_class():
    assert tuple(MODE_CLASSES) == MODES
    assert all(MODE_CLASSES[name].name == name for name in MODES)


@pytest.mark.parametrize("mode", MODES)
def test_an_int64_id_beyond_int32_never_lands_on_an_expert(tmp_path, mode):
    """2**32 + 3 read modulo 2**32 would be expert 3: it is an invalid id, and expert 3 counts nothing."""
    rec = make(tmp_path, mode)
    rec.start_record()
    with rec.with_forward_pass(), rec.with_current_layer(0):
        rec.on_select_experts(torch.tensor([[2**32 + 3, 5, 2**62, -1]], dtype=torch.int64))
    snap = rec.snapshot()
    assert snap.physical_count[0].tolist() == [0] * 5 + [1] + [0] * (EXPERTS - 6)
    assert int(np.asarray(snap.invalid_ids).sum()) == 2
