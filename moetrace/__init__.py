"""moetrace: observability and tracing for Mixture-of-Experts runtimes.

The module-level functions act on the process-wide recorder::

    import moetrace
    moetrace.configure(num_layers=4, num_physical_experts=8, top_k=2)
    moetrace.start_record()
    ...  # run the model (hooks call moetrace.get_recorder())
    path = moetrace.dump_record()
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__
from .config import CaptureConfig, RecorderConfig
from .process_recorder import NoOpRecorder, get_recorder, set_recorder
from .recorder import ExpertDistributionRecorder, RecorderStateError
from .snapshot import RecorderSnapshot
from .timing import PHASES

if TYPE_CHECKING:
    from .control import ControlServer

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


def configure(**fields: object) -> ExpertDistributionRecorder:
    """Build a recorder from :class:`RecorderConfig` fields and install it globally."""
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


def serve_control(*args: object, **kwargs: object) -> ControlServer:
    """Serve the HTTP control endpoint: see :func:`moetrace.control.serve_control`.

    Imported on first use, so ``import moetrace`` stays free of HTTP and exporter modules.
    """
    from .control import serve_control as _serve_control

    return _serve_control(*args, **kwargs)  # type: ignore[arg-type]
