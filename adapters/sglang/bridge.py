"""The recorder SGLang's model runner talks to once moetrace is attached: SGLang's own, plus moetrace's.

SGLang keeps one global expert distribution recorder per scheduler process
(``sglang.srt.eplb.expert_distribution``; since 0.5.18 it lives in
``runtime_context.get_resources()``). Every ``select_experts`` variant calls
its ``on_select_experts(topk_ids=...)`` with *physical* ids (padded rows
``-1``), inside ``with_current_layer(layer_id)`` of the decoder layer and
``with_forward_pass(forward_pass_id, forward_batch)`` of the model runner.
:class:`RecorderBridge` takes that recorder's place and forwards every call to
SGLang's recorder unchanged and to a moetrace recorder.

Each pass also tells moetrace its pass phase (:mod:`moetrace.pass_phase`) from the
``forward_batch.forward_mode`` SGLang runs (:data:`SGLANG_PASS_PHASES`), with the
batch's request count, on the host before the pass: the model runner enters
``with_forward_pass`` outside any CUDA graph it replays, so a replayed decode
graph is counted as ``decode``. When the pass's batch can be described from host
fields (:mod:`.batches`), its own phase (from the requests' prefill flags) wins;
the mode still names the passes it cannot describe (speculative verify and draft). Under DP
attention with the MoE input gathered over the TP group, the batch is placed at this rank's rows
of the gathered input at the pass end, once SGLang has sized the gather.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

from moetrace.batch import PassBatch

from ..failsafe import FailSafe
from .batches import gathered_pass_batch, sglang_pass_batch

__all__ = ["SGLANG_PASS_PHASES", "RecorderBridge", "sglang_pass_phase"]

#: SGLang ``ForwardMode`` names -> moetrace pass phases. Speculative verify and draft passes run on
#: the decode side of a PD-disaggregated deployment, so they count as ``decode``; a mode not listed
#: (a newer SGLang) is ``unknown``.
SGLANG_PASS_PHASES = {
    "EXTEND": "prefill", "SPLIT_PREFILL": "prefill", "DLLM_EXTEND": "prefill",
    "DECODE": "decode", "TARGET_VERIFY": "decode", "DRAFT_EXTEND": "decode", "DRAFT_EXTEND_V2": "decode", "PREBUILT": "decode",
    "MIXED": "mixed",
    "IDLE": "idle", "DUMMY_FIRST": "idle",
}


def sglang_pass_phase(forward_batch: Any) -> tuple[str, int]:
    """``(pass phase, requests)`` of an SGLang ``ForwardBatch`` (``("unknown", -1)`` without one; requests -1 when the
    batch gives no positive count, 0 for an idle pass); host fields only."""
    mode = getattr(forward_batch, "forward_mode", None)
    if mode is None:
        return "unknown", -1
    phase, requests = SGLANG_PASS_PHASES.get(getattr(mode, "name", ""), "unknown"), getattr(forward_batch, "batch_size", -1)
    if phase == "idle":  # no requests of its own (moetrace.pass_phase.REQUESTS_RULE)
        return phase, 0
    return phase, requests if isinstance(requests, int) and requests >= 1 else -1


logger = logging.getLogger(__name__)

_UNTIMED = contextlib.nullcontext()


class RecorderBridge:
    """SGLang's global recorder interface, forwarded to SGLang's recorder and to a moetrace recorder.

    What SGLang gets back is always what its own recorder gives: the dict
    ``with_forward_pass`` yields (the model runner reads ``"metrics"`` from
    it), dumps, ``get_current_pass_count_buffer``. A failure on moetrace's side
    trips ``failsafe`` (one warning, moetrace off from then on); it never reaches
    SGLang's forward, nor its recorder endpoints.

    Args:
        sglang_recorder: the recorder SGLang built (real or no-op).
        recorder: the moetrace recorder; its layers are SGLang's model layer ids.
        sglang_is_real: whether ``sglang_recorder`` records (its lifecycle calls are forwarded).
        metadata: SGLang's ``ExpertLocationMetadata`` the recorders were built from.
        failsafe: the instrumentation's switch (``None``: the bridge's own).
    """

    def __init__(self, sglang_recorder: Any, recorder: Any, sglang_is_real: bool, metadata: Any = None, failsafe: FailSafe | None = None) -> None:
        self.sglang = sglang_recorder
        self.moetrace = recorder
        self.metadata = metadata
        self.failsafe = failsafe if failsafe is not None else FailSafe("this SGLang engine")
        self._sglang_real = sglang_is_real
        self._layer: int | None = None
        self._batch_warned = False
        layout = getattr(getattr(recorder, "config", None), "layout", None)
        # DP attention with the MoE input gathered over the TP group: this rank's rows sit after the DP ranks before it
        self._gathered = layout is not None and int(layout.router_tp_size or 1) > int(layout.attn_tp_size or 1)
        self._dp_rank = int(layout.dp_rank) if layout is not None else 0

    # -------------------------------------------------------------- context managers
    @contextlib.contextmanager
    def with_forward_pass(self, forward_pass_id: int, forward_batch: Any) -> Iterator[Any]:
        with self.sglang.with_forward_pass(forward_pass_id, forward_batch) as outputs, self._moetrace_pass(forward_pass_id, forward_batch):
            yield outputs

    def _batch(self, forward_batch: Any) -> PassBatch | None:
        """The pass's requests from the ``ForwardBatch``'s host fields (this rank's own rows); ``None`` when the
        batch is not describable (logged once)."""
        if forward_batch is None:
            return None
        try:
            return sglang_pass_batch(forward_batch)
        except Exception as exc:  # never SGLang's problem: its rows are recorded without requests
            self._batch_failed(exc)
            return None

    def _batch_failed(self, exc: Exception) -> None:
        if not self._batch_warned:
            logger.warning("moetrace: the pass's requests could not be read from SGLang's ForwardBatch (%s); rows are recorded without requests", exc)
            self._batch_warned = True

    def _place_gathered(self, local: PassBatch | None, forward_batch: Any) -> None:
        """At the pass end of a gathered MoE input: this rank's batch moved to its rows of the gathered input
        (SGLang sized the gather inside the pass; host fields, :func:`.batches.gathered_pass_batch`)."""
        if local is None or not self.failsafe.on:
            return
        try:
            self.moetrace.set_batch(gathered_pass_batch(local, forward_batch, self._dp_rank))
        except Exception as exc:
            self._batch_failed(exc)

    @contextlib.contextmanager
    def _moetrace_pass(self, forward_pass_id: int, forward_batch: Any = None) -> Iterator[None]:
        scope = contextlib.ExitStack()
        local = None
        if self.failsafe.on:
            try:
                self.moetrace.set_pass_phase(*sglang_pass_phase(forward_batch))  # a batch, when there is one, names it too (and wins)
                local = self._batch(forward_batch)
                scope.enter_context(self.moetrace.with_forward_pass(forward_pass_id, batch=None if self._gathered else local))
            except Exception as exc:
                self.failsafe.trip(exc, "opening moetrace's pass")
        try:
            yield
        except BaseException:
            self._end_pass(scope, *sys.exc_info())  # moetrace discards the partial pass
            raise
        if self._gathered:
            self._place_gathered(local, forward_batch)
        self._end_pass(scope, None, None, None)

    def _end_pass(self, scope: contextlib.ExitStack, *exc_info: Any) -> None:
        try:
            scope.__exit__(*exc_info)
        except Exception as exc:
            self.failsafe.trip(exc, "closing moetrace's pass")

    @contextlib.contextmanager
    def with_current_layer(self, layer_idx: int) -> Iterator[None]:
        """SGLang's layer scope, and moetrace's (its phase timing times the layer and needs it for ``with_phase``)."""
        previous, self._layer = self._layer, layer_idx
        try:
            with self.sglang.with_current_layer(layer_idx), self.failsafe.entered(lambda: self.moetrace.with_current_layer(layer_idx), "moetrace's layer scope"):
                yield
        finally:
            self._layer = previous

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """moetrace's ``with_phase(name)`` for the current layer (``adapters.sglang.phases``); a null scope outside a layer or after an error."""
        if self.failsafe.on and self._layer is not None:
            return self.failsafe.entered(lambda: self.moetrace.with_phase(name), f"moetrace's {name} phase")
        return _UNTIMED

    def with_debug_name(self, debug_name: str) -> Any:
        return self.sglang.with_debug_name(debug_name)

    @contextlib.contextmanager
    def disable_this_region(self) -> Iterator[None]:
        with self.sglang.disable_this_region(), self.failsafe.entered(self.moetrace.disable_this_region, "moetrace's disabled region"):
            yield

    # -------------------------------------------------------------- hooks
    def on_select_experts(self, topk_ids: torch.Tensor) -> None:
        """``topk_ids [T, k]``: physical ids as SGLang's recorder gets them (padded rows ``-1``)."""
        self.sglang.on_select_experts(topk_ids=topk_ids)
        if self.failsafe.on and self._layer is not None:
            try:
                self.moetrace.on_select_experts(topk_ids, layer=self._layer)
            except Exception as exc:
                self.failsafe.trip(exc, "the bridge's on_select_experts")

    def get_current_pass_count_buffer(self, layer_idx: int) -> Any:
        """SGLang's per-pass count row for a fused map-and-record kernel (ROCm MegaMoE), or ``None``.

        The fused kernel counts into SGLang's buffer and skips
        ``on_select_experts``, which moetrace counts from. While moetrace
        records, the bridge answers ``None``: SGLang then takes its unfused
        path (logical-to-physical map, then ``on_select_experts``), which both
        recorders count identically. Otherwise SGLang's own answer.
        """
        if self.failsafe.on and self.moetrace.recording:
            return None
        getter = getattr(self.sglang, "get_current_pass_count_buffer", None)
        return getter(layer_idx) if getter is not None else None

    def on_deepep_dispatch_normal(self, local_physical_count_of_layer: Any, num_tokens_per_rank: Any, num_tokens_per_rdma_rank: Any, num_tokens_per_expert: Any) -> None:
        """DeepEP normal dispatch; ``num_tokens_per_rank [R]`` (tokens sent to each rank, once per rank) feeds moetrace's send counts."""
        self.sglang.on_deepep_dispatch_normal(local_physical_count_of_layer, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert)
        if self.failsafe.on and self._layer is not None and isinstance(num_tokens_per_rank, torch.Tensor):
            try:
                self.moetrace.on_dispatch(num_tokens_per_rank, layer=self._layer)
            except Exception as exc:
                self.failsafe.trip(exc, "the bridge's DeepEP dispatch count")

    def on_deepep_dispatch_low_latency(self, local_physical_count_of_layer: torch.Tensor) -> None:
        self.sglang.on_deepep_dispatch_low_latency(local_physical_count_of_layer)

    # -------------------------------------------------------------- EPLB
    def on_expert_location_update(self) -> None:
        """SGLang rebalanced (``ExpertLocationMetadata.update``, between forward passes).

        What moetrace recorded under the old map and has not dumped yet is
        dumped first, the recorder is reset (so that no trace mixes two maps:
        ``stat`` dumps are cumulative), and it then maps physical to logical
        ids with the new ``physical_to_logical_map``.
        """
        if not self.failsafe.on or self.metadata is None:
            return
        with self.failsafe.guarding("following SGLang's EPLB rebalance"):
            new = self.metadata.physical_to_logical_map_cpu.detach().numpy().astype("int64")
            config = self.moetrace.config
            old = config.physical_to_logical
            if old is not None and (old == new).all():
                return
            if self.moetrace.undumped_passes:
                path = self.moetrace.dump_record()
                logger.info("moetrace: EPLB rebalance; wrote what was recorded under the old expert map to %s", path)
            self.moetrace.reset()
            self.moetrace.config = config.replace(physical_to_logical=new)

    # -------------------------------------------------------------- lifecycle (SGLang's HTTP endpoints land here)
    def start_record(self) -> None:
        if self._sglang_real:
            self.sglang.start_record()
        if self.failsafe.on and not self.moetrace.recording:
            with self.failsafe.guarding("starting moetrace's recording"):
                self.moetrace.start_record()

    def stop_record(self) -> None:
        if self._sglang_real:
            self.sglang.stop_record()
        if self.failsafe.on and self.moetrace.recording:
            with self.failsafe.guarding("stopping moetrace's recording"):
                self.moetrace.stop_record()

    def dump_record(self, output_mode: str = "file") -> Any:
        """SGLang's dump (when its recorder is real); in ``"file"`` mode also a moetrace trace.

        ``"object"`` dumps (EPLB rebalancing asks for them periodically) are
        SGLang's only, so they do not write a moetrace file each time.
        """
        if output_mode == "file" and self.failsafe.on:
            # SGLang calls this on its scheduler thread, which runs the forward passes. While recording
            # the dump is a cut and the file is written in the background (serving goes on); after
            # stop_record (typically before a shutdown) it returns once the file is in place.
            with self.failsafe.guarding("moetrace's dump (SGLang's own dump goes on)"):
                recording = self.moetrace.recording
                path = self.moetrace.dump_record(wait=not recording)
                logger.info("moetrace: %s %s", "writing in the background" if recording else "wrote", path)
        return self.sglang.dump_record(output_mode=output_mode) if self._sglang_real else None

    @property
    def recording(self) -> bool:
        return bool(self.sglang.recording) or bool(self.moetrace.recording)

    @property
    def error(self) -> str | None:
        """The error that turned moetrace's side off, if any."""
        return self.failsafe.error

    def __getattr__(self, name: str) -> Any:
        # Anything newer SGLang versions add goes to SGLang's recorder unchanged.
        return getattr(self.sglang, name)
