"""The pass counter: every hook's counts, in three device ops, and the pass's tokens, once per pass.

A hook (:meth:`PassCounter.add_select`) issues three kernels whatever the mode:

1. ``add`` and 2. ``clamp_`` turn ids ``[T, k]`` into counter columns, written into the
   layer's rows of the pass stage ``[L, max_tokens, k]`` (the columns of
   :class:`~moetrace.trace.stat.CounterLayout`: column ``clamp(id + 2, 0, P + 2)``, so ``-1``
   lands in the padding column and ids below ``-1`` or at least ``P`` in the two invalid
   columns);
3. one ``scatter_add_`` of the gate (1 recording, 0 stopped) at those columns into the
   layer's counter row.

(``torch.bucketize`` would make the columns in one kernel, but on CPU it costs about 10x
``add`` and ``clamp_`` together at DeepSeek-V3 decode shape: ``docs/benchmarks.md``.)

The tokens of a pass (rows with at least one id that is not -1, in the layer that has most)
are counted at pass end, once for all layers, from the stage (:meth:`PassCounter.fold`): under
CUDA-graph replay no hook's Python runs, so tokens must be counted from what the device holds,
and the stage is what the replayed hooks wrote. The stage is set back to the padding column
after each pass, so a layer (or a replayed graph) that writes fewer rows adds nothing there.
``per_token`` mode reads each pass's ids back from the same stage, and which of its rows are
tokens from the same count (:meth:`PassCounter.rows_with_ids`).

A layer given more rows in a pass than the stage holds (``max_tokens_per_pass``, e.g. a
prefill larger than configured) is counted directly in ``stat`` and ``per_pass`` mode, with
temporaries and the token count in the hook (:meth:`PassCounter._add_unstaged`); ``per_token``
mode, which keeps every row, refuses it.

Pass phases (:mod:`moetrace.pass_phase`) are host state the adapter sets per pass; at pass
end the pass's rows are added into that phase's row of ``[Q, L, C]`` device totals. No hook
reads the phase.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import RecorderConfig
from ..graphs import is_capturing
from ..pass_phase import PASS_PHASES
from ..trace.stat import CounterLayout

__all__ = ["PassCounter"]


class PassCounter:
    """Counts of the current pass ``current [L, C]`` and running ``totals [L, C]`` (int64).

    ``ones`` is a static buffer of 1 (recording) or 0 (stopped) used as the ``scatter_add_``
    source: a CUDA graph captured with recording on can be switched off and on without
    re-capture; ``gate`` is its first element. ``stage [L, max_tokens, k]`` holds the counter
    column of every id the pass's hooks gave, layer by layer (``layer_rows [L]``, host ints:
    rows each layer holds, in call order, so the micro-batches of one layer follow each other;
    they start over at every pass and every graph capture, whose offsets a replay repeats).
    ``rows`` is a host bound on the rows any layer holds in the pass (the most a hook wrote in
    this pass or in any graph capture, since a replay tells the host nothing).

    ``pass_tokens [1]`` (the tokens of the pass just folded) and ``token_total [1]`` (since the
    last reset) are updated on the device at pass end, and so are the same totals split by pass
    phase, ``pass_phase_totals [Q, L, C]`` and ``pass_phase_tokens [Q]`` (their sums over ``Q`` are
    ``totals`` and ``token_total``).

    Args:
        keep_rows: refuse a layer's rows that do not fit the stage (``per_token`` mode keeps
            every row), instead of counting them directly.
    """

    def __init__(self, config: RecorderConfig, layout: CounterLayout, keep_rows: bool) -> None:
        self.layout, self.keep_rows = layout, keep_rows
        shape = (config.num_layers, layout.width)
        device = config.device
        stage = (config.num_layers, config.max_tokens_per_pass, config.top_k)
        self.device: torch.device = device  # type: ignore[assignment]
        self.current = torch.zeros(shape, dtype=torch.int64, device=device)
        self.totals = torch.zeros(shape, dtype=torch.int64, device=device)
        self.ones = torch.zeros(config.max_tokens_per_pass * config.top_k, dtype=torch.int64, device=device)
        self.gate = self.ones[:1]
        # int64 whatever the ids' dtype: an int64 id is then never narrowed before it is clamped, so
        # none, however large, lands on an expert's column.
        self.stage = torch.full(stage, layout.padding, dtype=torch.int64, device=device)
        # Pass end: which ids are not -1, each row padded to whole 8-byte words so that "any id of
        # the row" is one word compared with 0 (a reduction over k bools is slow on CPU).
        words = -(-config.top_k // 8)
        self._real = torch.zeros((*stage[:2], 8 * words), dtype=torch.bool, device=device)
        self._real_words = self._real.view(torch.int64)  # [L, max_tokens, words]
        self._real_rows = torch.empty(stage[:2], dtype=torch.bool, device=device)  # [L, max_tokens] rows with one
        self._layer_tokens = torch.zeros(config.num_layers, dtype=torch.int64, device=device)
        # Each layer's counter row and stage as views made once: a hook slices nothing it can avoid.
        self._layer_counts, self._layer_stage = list(self.current.unbind(0)), list(self.stage.unbind(0))
        # Each layer's last hook's views (_rows_views): making them costs about as much host time as
        # a kernel launch on CPU, and consecutive passes usually give a layer the same rows.
        self._hook_views: list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * config.num_layers
        self.layer_rows = [0] * config.num_layers
        self._no_rows = [0] * config.num_layers
        self.rows = self.captured_rows = 0
        self.pass_tokens = torch.zeros(1, dtype=torch.int64, device=device)
        self.token_total = torch.zeros(1, dtype=torch.int64, device=device)
        self.pass_phase_totals = torch.zeros((len(PASS_PHASES), *shape), dtype=torch.int64, device=device)
        self.pass_phase_tokens = torch.zeros(len(PASS_PHASES), dtype=torch.int64, device=device)
        self.pass_phase_host = np.zeros((2, len(PASS_PHASES)), dtype=np.int64)  # host: passes, requests of each pass phase

    def set_gate(self, on: bool) -> None:
        """Switch counting on or off (also inside captured CUDA graphs)."""
        self.ones.fill_(1 if on else 0)

    def restart_rows(self) -> None:
        """A pass or a graph capture begins: each layer's rows start again at row 0."""
        self.layer_rows[:] = self._no_rows
        self.rows = 0

    def add_select(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count ``topk_ids [T, k]`` into layer ``layer`` (three kernels; see the module docstring).

        Ids in ``[0, P)`` count for their expert, ``-1`` in the padding column, any other id in
        one of the two invalid columns; the pass end counts the rows that are not all -1
        (padding rows of a CUDA graph's static batch are) as its tokens. The stage is int64, so an
        id of any size lands in its own column or an invalid one (``2**63 - 1`` wraps to the low one).

        Raises:
            ValueError: (``keep_rows``) the layer's rows in this pass would outgrow ``max_tokens_per_pass``.
        """
        start, room = self.layer_rows[layer], self.stage.shape[1]
        end = start + topk_ids.shape[0]
        if end > room:
            if self.keep_rows:
                before = f" after {start} rows already given for layer {layer} in this pass (micro-batches)" if start else ""
                raise ValueError(f"pass of {end} tokens{before} exceeds max_tokens_per_pass={room}; raise it in RecorderConfig")
            self._add_unstaged(layer, topk_ids)
            return
        _, _, columns, flat, gates = self._rows_views(layer, start, end)
        torch.add(topk_ids, 2, out=columns)
        columns.clamp_(0, self.layout.above)
        self._layer_counts[layer].scatter_add_(0, flat, gates)
        self.layer_rows[layer] = end
        if end > self.rows:
            self.rows = end
            if end > self.captured_rows and is_capturing(self.device):
                self.captured_rows = end  # a replay of this graph writes this many rows, no hook telling

    def _rows_views(self, layer: int, start: int, end: int) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(start, end, columns [n, k], flat [n * k], gates [n * k])``: layer ``layer``'s stage rows
        ``[start, end)``, the same flat, and the ``scatter_add_`` source; made again only when the
        layer's rows differ from its last hook's (views are host objects: no device memory)."""
        views = self._hook_views[layer]
        if views is None or views[0] != start or views[1] != end:
            columns = self._layer_stage[layer][start:end]
            flat = columns.view(-1)
            views = self._hook_views[layer] = (start, end, columns, flat, self.ones[: flat.shape[0]])
        return views

    def _add_unstaged(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count rows that do not fit the stage directly (temporaries), tokens included."""
        columns = (topk_ids.long() + 2).clamp_(0, self.layout.above)
        row = self.current[layer]
        row.scatter_add_(0, columns.view(-1), self.gate.expand(columns.numel()))
        real = torch.ne(columns, self.layout.padding).any(dim=1)
        tokens = self.layout.tokens
        row[tokens : tokens + 1].addcmul_(real.sum(dim=0, keepdim=True), self.gate)

    @property
    def pass_rows(self) -> int:
        """The bound on the rows any layer of the pass holds in the stage (a replay's included)."""
        return max(self.rows, self.captured_rows)

    def add_dispatch(
        self,
        layer: int,
        send_counts: torch.Tensor,
        recv_counts: torch.Tensor | None,
        dropped: torch.Tensor | None,
    ) -> None:
        """Add ``send_counts [R]``, ``recv_counts [R]`` and ``dropped []`` to layer ``layer``."""
        row = self.current[layer]
        row[self.layout.send].addcmul_(send_counts, self.gate)
        if recv_counts is not None:
            row[self.layout.recv].addcmul_(recv_counts, self.gate)
        if dropped is not None:
            row[self.layout.dropped].addcmul_(dropped.reshape(()), self.gate.reshape(()))

    def _count_tokens(self) -> None:
        """Pass end: each layer's rows of the stage that hold an id other than -1 into its tokens
        column (gated), once for all layers; into preallocated buffers."""
        rows = self.pass_rows
        if rows == 0:
            return
        k = self.stage.shape[2]
        torch.ne(self.stage[:, :rows], self.layout.padding, out=self._real[:, :rows, :k])
        real_rows = self._real_rows[:, :rows]
        torch.any(self._real_words[:, :rows], dim=2, out=real_rows)
        torch.sum(real_rows, dim=1, out=self._layer_tokens)
        tokens = self.layout.tokens
        self.current[:, tokens].addcmul_(self._layer_tokens, self.gate)

    def rows_with_ids(self, out: torch.Tensor) -> None:
        """After :meth:`fold`: into ``out [pass_rows]`` (bool), whether each row of the pass holds an
        id other than -1 in any layer (a token; all -1 is a padding row of a static batch), from
        what the pass end's token count computed: one kernel, into ``out``."""
        rows = self.pass_rows
        if rows:
            torch.amax(self._real_rows[:, :rows], dim=0, out=out)

    def fold(self, phase: int, requests: int) -> None:
        """Pass end: count the pass's tokens, add the pass into the totals and its tokens into
        ``token_total``, and both into pass phase ``phase``'s rows (a host int: a view, no device
        read), with the pass's ``requests`` (-1: unknown, adds nothing) on the host; the pass
        (its rows and stage) stays readable until :meth:`clear`."""
        self._count_tokens()
        self.pass_phase_host[0, phase] += 1
        self.pass_phase_host[1, phase] += max(requests, 0)
        self.totals.add_(self.current)
        self.pass_phase_totals[phase].add_(self.current)
        tokens = self.layout.tokens
        torch.amax(self.current[:, tokens : tokens + 1], dim=0, out=self.pass_tokens)
        self.token_total.add_(self.pass_tokens)
        self.pass_phase_tokens[phase : phase + 1].add_(self.pass_tokens)

    def clear(self) -> None:
        """Start the next pass empty: zero counts, the stage's rows back to the padding column."""
        self.current.zero_()
        rows = self.pass_rows
        if rows:
            self.stage[:, :rows].fill_(self.layout.padding)

    def reset(self) -> None:
        """A new recording: everything zero (the stage too: graph replays write it while nothing is recorded)."""
        self.current.zero_()
        self.stage.fill_(self.layout.padding)
        self.totals.zero_()
        self.pass_tokens.zero_()
        self.token_total.zero_()
        self.pass_phase_totals.zero_()
        self.pass_phase_tokens.zero_()
        self.pass_phase_host[:] = 0
