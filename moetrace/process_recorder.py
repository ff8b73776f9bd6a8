"""The process-wide recorder: the one every hook site asks for, a no-op until one is set.

Engine adapters and the reference runtime call :func:`get_recorder` at each hook site, so
a process that never configures moetrace pays one attribute lookup and a call that does
nothing (:class:`NoOpRecorder`); :func:`set_recorder` (or :func:`configure`) installs an
:class:`~moetrace.recorder.ExpertDistributionRecorder`. :func:`start_record`, :func:`stop_record`
and :func:`dump_record` act on whichever is installed; the package root exports all of them
(``moetrace.configure`` ...).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from .batch import PassBatch
from .config import RecorderConfig
from .pass_phase import pass_phase_code, pass_requests
from .recorder import ExpertDistributionRecorder, RecorderStateError
from .snapshot import RecorderSnapshot
from .timing import UNTIMED

__all__ = ["NoOpRecorder", "Recorder", "configure", "dump_record", "get_recorder", "set_recorder", "start_record", "stop_record"]


class NoOpRecorder:
    """The global default: every hook and context manager does nothing.

    Lifecycle calls raise :class:`RecorderStateError` telling the user to
    configure a real recorder first.
    """

    recording = False
    mode = "none"
    num_passes = 0
    last_dump_path: Path | None = None

    current_batch: PassBatch | None = None

    def with_forward_pass(self, forward_pass_id: int | None = None, batch: PassBatch | None = None) -> contextlib.nullcontext[int]:
        return contextlib.nullcontext(-1 if forward_pass_id is None else forward_pass_id)

    def set_batch(self, batch: PassBatch | None) -> None:
        return None

    def with_current_layer(self, layer_idx: int) -> contextlib.nullcontext[int]:
        return contextlib.nullcontext(layer_idx)

    def disable_this_region(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def with_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return UNTIMED

    def set_pass_phase(self, phase: str | int, num_requests: int = -1) -> None:
        pass_requests(pass_phase_code(phase), num_requests)  # refuses what a configured recorder would

    def on_select_experts(self, topk_ids: torch.Tensor, layer: int | None = None) -> None:
        return None

    def on_dispatch(self, send_counts: torch.Tensor, recv_counts: torch.Tensor | None = None, dropped: torch.Tensor | None = None, layer: int | None = None) -> None:
        return None

    def _unconfigured(self, what: str) -> RecorderStateError:
        return RecorderStateError(f"{what}: no recorder is configured; call moetrace.configure(...) or set_recorder(...) first")

    def start_record(self) -> None:
        raise self._unconfigured("start_record")

    def stop_record(self) -> None:
        raise self._unconfigured("stop_record")

    def dump_record(self, path: Path | str | None = None, wait: bool = True) -> Path:
        raise self._unconfigured("dump_record")

    def reset(self) -> None:
        return None

    def snapshot(self) -> RecorderSnapshot:
        raise self._unconfigured("snapshot")

    def status(self) -> dict[str, object]:
        return {"configured": False, "recording": False, "mode": "none", "passes": 0, "tokens": 0, "last_dump_path": None, "output_dir": None, "errors": []}


Recorder = ExpertDistributionRecorder | NoOpRecorder
_global_recorder: Recorder = NoOpRecorder()


def get_recorder() -> Recorder:
    """The process-wide recorder (a :class:`NoOpRecorder` until one is set)."""
    return _global_recorder


def set_recorder(recorder: Recorder | None) -> Recorder:
    """Install ``recorder`` as the process-wide recorder (``None`` restores the no-op); returns the previous one."""
    global _global_recorder
    previous = _global_recorder
    _global_recorder = recorder if recorder is not None else NoOpRecorder()
    return previous



def configure(**fields: object) -> ExpertDistributionRecorder:
    """Build a recorder from :class:`~moetrace.config.RecorderConfig` fields and install it as the process-wide one."""
    recorder = ExpertDistributionRecorder(RecorderConfig(**fields))  # type: ignore[arg-type]
    set_recorder(recorder)
    return recorder


def start_record() -> None:
    """``get_recorder().start_record()``."""
    get_recorder().start_record()


def stop_record() -> None:
    """``get_recorder().stop_record()``."""
    get_recorder().stop_record()


def dump_record(path: str | Path | None = None, wait: bool = True) -> Path:
    """``get_recorder().dump_record(path, wait)``."""
    return get_recorder().dump_record(path, wait)
