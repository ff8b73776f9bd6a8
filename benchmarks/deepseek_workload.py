"""DeepSeek-V3's decode shape through the recorder's hooks: the workload the recording benchmarks share.

58 MoE layers, 288 physical slots (256 experts + 32 redundant), top-8, 256 tokens a pass. A pass
is the 58 ``on_select_experts`` calls inside ``with_forward_pass`` and the pass end, on this
machine's CPU: the forward thread does the hooks and almost nothing else, so what a recording
costs is what is timed. Only the public recorder API is used, so a script built on this module
measures an older checkout too (``PYTHONPATH`` or that checkout's virtualenv).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from moetrace import ExpertDistributionRecorder, RecorderConfig

__all__ = ["LAYERS", "SLOTS", "TOKENS", "TOP_K", "bare_ops", "burning", "forward", "paced_forward", "recorder", "routes"]

LAYERS, SLOTS, TOP_K, TOKENS = 58, 288, 8, 256


def routes(seed: int = 0, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """One ``[TOKENS, TOP_K]`` int64 id tensor per layer on ``device``: distinct ids per token, Zipf-skewed slots."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, SLOTS + 1)
    out = []
    for _ in range(LAYERS):
        keys = rng.random((TOKENS, SLOTS)) ** (1.0 / weights)
        out.append(torch.as_tensor(np.argsort(-keys, axis=1)[:, :TOP_K].astype(np.int64), device=device))
    return out


def forward(rec: ExpertDistributionRecorder, ids: list[torch.Tensor]) -> float:
    """One forward pass through the hooks; its seconds."""
    start = time.perf_counter()
    with rec.with_forward_pass():
        for layer in range(LAYERS):
            with rec.with_current_layer(layer):
                rec.on_select_experts(ids[layer])
    return time.perf_counter() - start


def paced_forward(host_work: Callable[[], object], pass_s: float, overlapped: bool = False) -> None:
    """One forward pass: ``host_work`` (the hooks, :func:`forward`, or the control's :func:`bare_ops`)
    with ``pass_s`` of stand-in device time, after it (``overlapped`` false: its ops are part of the
    pass's time, as on this CPU, where they are the device's work done by the forward thread) or
    alongside it (``overlapped``: as on a GPU, where the host queues a pass's kernels while the
    device runs, and the pass ends when the device does, so it takes the longer of the host's work
    and ``pass_s``; the hooks' own kernels, device time on a GPU, are not modelled)."""
    start = time.perf_counter()
    host_work()
    if pass_s:
        time.sleep(max(0.0, start + pass_s - time.perf_counter()) if overlapped else pass_s)


def burning(work: Callable[[], object], cpu_s: float) -> Callable[[], None]:
    """``work``, then a busy loop until this thread has used ``cpu_s`` more seconds of CPU."""

    def run() -> None:
        work()
        end = time.thread_time() + cpu_s
        while time.thread_time() < end:
            pass

    return run


def bare_ops(ids: list[torch.Tensor], pass_end: bool = True, staging_rows: int = 0) -> Callable[[], None]:
    """A pass of the recording's device ops without moetrace, for controls: per layer, the two ops
    a hook issues (:mod:`moetrace.recording.pass_counter`: ``copy_`` of its ids into its rows of an
    int64 stage ``[L, T, k]``, ``fill_`` of its row end), then with ``pass_end`` the pass end's
    count of every layer at once (``add_``, ``clamp_``, one ``scatter_add_`` into ``[L, SLOTS + 3]``
    counts, the stage set back to -1), on ``ids`` (one ``[T, k]`` tensor per layer, ``L`` of them),
    with none of the recorder's host work, token count or files. ``staging_rows`` (with
    ``pass_end``): also ``per_token``'s move of the pass's rows, one ``gather`` through a lookup
    table from the stage into the next ``T`` rows of an int16 staging buffer ``[staging_rows, L, k]``
    (:class:`moetrace.recording.streams.TokenStream`), round the buffer."""
    device, (tokens, top_k) = ids[0].device, ids[0].shape
    stage = torch.full((len(ids), tokens, top_k), -1, dtype=torch.int64, device=device)
    ends = torch.zeros(len(ids), dtype=torch.int64, device=device)
    counts = torch.zeros((len(ids), SLOTS + 3), dtype=torch.int64, device=device)
    ones = torch.ones(tokens * top_k, dtype=torch.int64, device=device).expand(len(ids), -1)
    hooks = list(zip(ids, stage.unbind(0), ends.unbind(0), strict=True))
    staging = torch.zeros((staging_rows, len(ids), top_k), dtype=torch.int16, device=device)
    lut = torch.arange(-2, SLOTS + 1, dtype=torch.int16, device=device).expand(tokens, len(ids), -1)
    filled = [0]

    def one_pass() -> None:
        for layer_ids, rows, end in hooks:
            rows.copy_(layer_ids)
            end.fill_(tokens)
        if pass_end:
            stage.add_(2).clamp_(0, SLOTS + 2)
            counts.scatter_add_(1, stage.view(len(ids), -1), ones)
            if staging_rows:
                start = filled[0] if filled[0] + tokens <= staging_rows else 0
                torch.gather(lut, 2, stage.transpose(0, 1), out=staging[start : start + tokens])
                filled[0] = start + tokens
            stage.fill_(-1)

    return one_pass


def recorder(mode: str, output_dir: Path, **settings: object) -> ExpertDistributionRecorder:
    """A recorder of the DeepSeek-V3 decode shape in ``mode`` writing to ``output_dir`` (``settings``: other config fields)."""
    return ExpertDistributionRecorder(RecorderConfig(
        num_layers=LAYERS, num_physical_experts=SLOTS, top_k=TOP_K, mode=mode, output_dir=output_dir,
        max_tokens_per_pass=TOKENS, **settings,  # type: ignore[arg-type]
    ))
