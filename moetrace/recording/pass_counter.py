"""The pass counter: a hook copies its ids in two device ops; the pass end counts every layer at once.

A hook (:meth:`PassCounter.add_select`) issues two kernels whatever the mode:

1. ``copy_`` of ids ``[T, k]`` (any integer dtype) into the layer's rows of the int64 pass stage
   ``[L, max_tokens, k]``, after the rows its earlier calls in the pass wrote (micro-batches);
2. ``fill_`` of the layer's row end ``layer_end [L]`` on the device: the rows it holds. A replayed
   CUDA graph runs no hook's Python, so the host cannot know which rows a replay wrote.

The pass end (:meth:`PassCounter.fold`) counts the pass from the stage, for all layers at once and
in a fixed number of kernels however many layers there are: ``add_`` and ``clamp_`` turn the
stage's ids into counter columns in place (the columns of
:class:`~moetrace.trace.stat.CounterLayout`: column ``clamp(id + 2, 0, P + 2)``, so ``-1`` lands in
the padding column and ids below ``-1`` or at least ``P`` in the two invalid columns), one
``scatter_add_`` along the columns adds the gate (1 recording, 0 stopped) at each into its layer's
counter row, and the padding column gives back the rows a layer was not given (``stage rows -
layer_end``: they hold -1, the stage's empty value). Under CUDA-graph replay this is what the
device holds, so it stays exact with no hook's Python running. (Counting in each hook took three
kernels a layer, ``add``, ``clamp_`` and ``scatter_add_``: ``docs/benchmarks.md``.)

The tokens of a pass (rows with at least one id that is not -1, in the layer that has most)
are counted at the same pass end, from the same columns (:meth:`PassCounter._count_tokens`).
The stage is set back to -1 after each pass, so a layer (or a replayed graph) that writes fewer
rows leaves nothing there. ``per_token`` mode reads each pass's ids back from the stage's columns
after :meth:`PassCounter.fold`, and which of its rows are tokens from the same count
(:meth:`PassCounter.rows_with_ids`).

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
    """Counts of the current pass ``current [L, C]`` and, since the last reset, by pass phase (int64).

    ``ones`` is a static buffer of 1 (recording) or 0 (stopped) used as the ``scatter_add_``
    source: a CUDA graph captured with recording on can be switched off and on without
    re-capture; ``gate`` is its first element. ``stage [L, max_tokens, k]`` holds every id the
    pass's hooks gave (int64), layer by layer, -1 where none was given, and after :meth:`fold`
    their counter columns (``layer_rows [L]``, host ints: rows each layer holds, in call order,
    so the micro-batches of one layer follow each other; they start over at every pass and every
    graph capture, whose offsets a replay repeats; ``layer_end [L]``: the same on the device,
    written by the hooks, so a replay's too). ``rows`` is a host bound on the rows any layer
    holds in the pass (the most a hook wrote in this pass or in any graph capture, since a
    replay tells the host nothing).

    ``pass_tokens [1]`` (the tokens of the pass just folded) is updated on the device at pass end,
    and so are the totals since the last reset, by pass phase: ``pass_phase_totals [Q, L, C]`` and
    ``pass_phase_tokens [Q]``. Their sums over ``Q`` (:meth:`totals`, :meth:`token_total`) are
    taken only when read (dumps, checkpoints), not kept beside them at every pass end.

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
        self.ones = torch.zeros(config.max_tokens_per_pass * config.top_k, dtype=torch.int64, device=device)
        self.gate = self.ones[:1]
        # int64 whatever the ids' dtype: an int64 id is then never narrowed before it is clamped, so
        # none, however large, lands on an expert's column.
        self.stage = torch.full(stage, -1, dtype=torch.int64, device=device)
        self.layer_end = torch.zeros(config.num_layers, dtype=torch.int64, device=device)
        self._unwritten = torch.zeros(config.num_layers, dtype=torch.int64, device=device)  # pass end: layer_end - rows
        # Pass end: which ids are not -1, each row padded to whole 8-byte words so that "any id of
        # the row" is one word compared with 0 (a reduction over k bools is slow on CPU).
        words = -(-config.top_k // 8)
        self._real = torch.zeros((*stage[:2], 8 * words), dtype=torch.bool, device=device)
        self._real_words = self._real.view(torch.int64)  # [L, max_tokens, words]
        self._real_rows = torch.empty(stage[:2], dtype=torch.bool, device=device)  # [L, max_tokens] rows with one
        self._layer_tokens = torch.zeros(config.num_layers, dtype=torch.int64, device=device)
        # Each layer's stage and row end as views made once: a hook slices nothing it can avoid.
        self._layer_stage, self._layer_ends = list(self.stage.unbind(0)), list(self.layer_end.unbind(0))
        # Each layer's last hook's rows of the stage (_rows_view): making a view costs about as much
        # host time as a kernel launch on CPU, and consecutive passes usually give a layer the same rows.
        self._hook_views: list[tuple[int, int, torch.Tensor] | None] = [None] * config.num_layers
        self.layer_rows = [0] * config.num_layers
        self._no_rows = [0] * config.num_layers
        self.rows = self.captured_rows = 0
        self.pass_tokens = torch.zeros(1, dtype=torch.int64, device=device)
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
        """Stage ``topk_ids [T, k]`` for layer ``layer``, counted at pass end (two kernels; see the module docstring).

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
        self._rows_view(layer, start, end).copy_(topk_ids)
        self._layer_ends[layer].fill_(end)
        self.layer_rows[layer] = end
        if end > self.rows:
            self.rows = end
            if end > self.captured_rows and is_capturing(self.device):
                self.captured_rows = end  # a replay of this graph writes this many rows, no hook telling

    def _rows_view(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Layer ``layer``'s stage rows ``[start, end)``, ``[n, k]``; made again only when the layer's
        rows differ from its last hook's (a view is a host object: no device memory)."""
        views = self._hook_views[layer]
        if views is None or views[0] != start or views[1] != end:
            views = self._hook_views[layer] = (start, end, self._layer_stage[layer][start:end])
        return views[2]

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

    def _count_stage(self, rows: int) -> None:
        """Pass end: the stage's first ``rows`` rows of every layer into counter columns (in place),
        counted into ``current`` (gated), less the padding of the rows a layer was not given; five
        kernels for all layers."""
        layers, _, k = self.stage.shape
        columns = self.stage[:, :rows]
        columns.add_(2).clamp_(0, self.layout.above)
        self.current.scatter_add_(1, columns.view(layers, rows * k), self.ones[: rows * k].expand(layers, -1))
        self._take_back_unwritten(rows)

    def _take_back_unwritten(self, rows: int) -> None:
        """The padding :meth:`_count_stage` counted in the rows ``[layer_end, rows)`` of each layer,
        which hold -1 because no hook wrote them, taken back (gated)."""
        torch.sub(self.layer_end, rows, out=self._unwritten)
        self.current[:, self.layout.padding].addcmul_(self._unwritten, self.gate, value=self.stage.shape[2])

    def _count_tokens(self, rows: int) -> None:
        """Pass end, after :meth:`_count_stage`: each layer's rows of the stage that hold an id other
        than -1 into its tokens column (gated), once for all layers; into preallocated buffers."""
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
        """Pass end: count the pass's tokens, and add the pass and its tokens into pass phase
        ``phase``'s totals (a host int: a view, no device read), with the pass's ``requests`` (-1:
        unknown, adds nothing) on the host; the pass (its rows and stage) stays readable until
        :meth:`clear`."""
        rows = self.pass_rows
        if rows:
            self._count_stage(rows)
            self._count_tokens(rows)
        self.pass_phase_host[0, phase] += 1
        self.pass_phase_host[1, phase] += max(requests, 0)
        self.pass_phase_totals[phase].add_(self.current)
        tokens = self.layout.tokens
        torch.amax(self.current[:, tokens : tokens + 1], dim=0, out=self.pass_tokens)
        self.pass_phase_tokens[phase : phase + 1].add_(self.pass_tokens)

    def totals(self) -> torch.Tensor:
        """The counts since the last reset, ``[L, C]``: a new device tensor (the sum over pass phases)."""
        return self.pass_phase_totals.sum(dim=0)

    def token_total(self) -> torch.Tensor:
        """The tokens since the last reset, ``[1]``: a new device tensor (the sum over pass phases)."""
        return self.pass_phase_tokens.sum(dim=0, keepdim=True)

    def clear(self) -> None:
        """Start the next pass empty: zero counts, the stage's rows back to -1, no row ends."""
        self.current.zero_()
        rows = self.pass_rows
        if rows:
            self.stage[:, :rows].fill_(-1)
            self.layer_end.zero_()

    def reset(self) -> None:
        """A new recording: everything zero (the stage too: graph replays write it while nothing is recorded)."""
        self.current.zero_()
        self.stage.fill_(-1)
        self.layer_end.zero_()
        self.pass_tokens.zero_()
        self.pass_phase_totals.zero_()
        self.pass_phase_tokens.zero_()
        self.pass_phase_host[:] = 0
