"""moetrace: observability and tracing for Mixture-of-Experts runtimes.

The module-level functions act on the process-wide recorder::

    import moetrace
    moetrace.configure(num_layers=4, num_physical_experts=8, top_k=2)
    moetrace.start_record()
    ...  # run the model (hooks call moetrace.get_recorder())
    path = moetrace.dump_record()

``import moetrace`` loads only the version: every other public name is imported from its module
on first use (PEP 562), so the offline commands (``moetrace analyze``, ``verify``, ``report`` ...),
which read traces with numpy and h5py, never import torch; the first ``moetrace.configure`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__
from .lazy import lazy_attributes

if TYPE_CHECKING:
    from .config import CaptureConfig, RecorderConfig
    from .control import serve_control
    from .process_recorder import (
        NoOpRecorder,
        configure,
        dump_record,
        get_recorder,
        set_recorder,
        start_record,
        stop_record,
    )
    from .recorder import ExpertDistributionRecorder, RecorderStateError
    from .snapshot import RecorderSnapshot
    from .timing import PHASES

__all__ = [
    "PHASES",
    "CaptureConfig",
    "ExpertDistributionRecorder",
    "NoOpRecorder",
    "RecorderConfig",
    "RecorderSnapshot",
    "RecorderStateError",
    "__version__",
    "configure",
    "dump_record",
    "get_recorder",
    "serve_control",
    "set_recorder",
    "start_record",
    "stop_record",
]

_LAZY = {
    "PHASES": "timing",
    "CaptureConfig": "config",
    "RecorderConfig": "config",
    "ExpertDistributionRecorder": "recorder",
    "RecorderStateError": "recorder",
    "RecorderSnapshot": "snapshot",
    "NoOpRecorder": "process_recorder",
    "configure": "process_recorder",
    "dump_record": "process_recorder",
    "get_recorder": "process_recorder",
    "set_recorder": "process_recorder",
    "start_record": "process_recorder",
    "stop_record": "process_recorder",
    "serve_control": "control",
}

__getattr__ = lazy_attributes(__name__, _LAZY)
