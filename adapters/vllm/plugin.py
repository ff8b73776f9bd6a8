"""The ``vllm.general_plugins`` entry point: instrument the model inside vLLM's worker processes.

vLLM calls :func:`register` in every process it starts (front end, engine
core, workers), possibly several times. With ``MOETRACE_ENABLED=1`` it
patches vLLM's model loaders once per process; every MoE model loaded there
afterwards is instrumented with a recorder configured from the environment:

=========================  ==========  ===============================================
variable                   default     meaning
=========================  ==========  ===============================================
``MOETRACE_ENABLED``       unset       ``1`` turns the plugin on (anything else: off)
``MOETRACE_MODE``          ``stat``    recorder mode: ``stat``, ``per_pass``, ``per_token``
``MOETRACE_OUTPUT_DIR``    ``.``       where dumps (and control endpoint files) go
``MOETRACE_WINDOW``        ``1000``    passes kept in the ``stat`` window
``MOETRACE_AUTOSTART``     ``1``       start recording once the engine has warmed up
``MOETRACE_DUMP_ON_EXIT``  ``1``       dump what was recorded when the worker exits
``MOETRACE_CONTROL_PORT``  unset       serve the HTTP control endpoint on this port
                                       (plus the worker's local rank; ``0``: a free port)
``MOETRACE_CONTROL_HOST``  127.0.0.1   control endpoint bind address
``MOETRACE_CONTROL_TOKEN`` unset       bearer token the control endpoint requires
=========================  ==========  ===============================================

Warm-up and profiling passes are not recorded: recording starts after the
worker's ``compile_or_warm_up_model`` returns, and from then on each pass
carries its step's requests (the worker's model runner is followed:
:mod:`moetrace.adapters.vllm.batches`). With a control endpoint, each
worker writes ``moetrace-control-<pid>.json`` (its URL, pid, rank) into the
output directory, so that ``port=0`` can be found. The variables are read and
checked by :class:`moetrace.adapters.settings.PluginSettings`,
the reader the SGLang plugin shares.

Nothing here stops vLLM. Every step (reading the settings, the version check,
the loader patch, instrumenting the model, the warm-up patch, following the
steps, the control endpoint, the dump on exit) and every hook in the model's
forward runs behind one :class:`~moetrace.adapters.failsafe.FailSafe` per
process: the first exception is one warning (logger ``moetrace.adapters``),
moetrace is off in that process from then on, and vLLM loads and serves as
without moetrace.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import multiprocessing.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moetrace.recorder import RecorderStateError

from ..base import Instrumentation, NoMoELayersError
from ..failsafe import FailSafe
from ..settings import PluginSettings
from .layers import check_vllm_version

__all__ = ["WorkerSession", "current_session", "register"]

log = logging.getLogger("moetrace.vllm")

_MARK = "__moetrace_plugin__"


class WorkerSession:
    """What the plugin does in one worker process: instrument, start, serve, dump on exit.

    ``failsafe`` is the process's switch: the plugin's steps and the model's hooks run behind it.
    """

    def __init__(self, settings: PluginSettings, failsafe: FailSafe) -> None:
        self.settings = settings
        self.failsafe = failsafe
        self.handle: Instrumentation | None = None
        self.control: Any = None
        self.control_file: Path | None = None
        self.dump_path: Path | None = None
        self._exited = False

    def on_model_loaded(self, model: Any, vllm_config: Any) -> None:
        """Instrument ``model`` (the first MoE model of this process; later ones are skipped); never raises."""
        if not self.failsafe.on:
            return
        if self.handle is not None:
            if self.handle.target is not model:
                log.warning("moetrace: another MoE model was loaded in this process (%s); only the first one is recorded", type(model).__name__)
            return
        with self.failsafe.guarding("instrumenting the model vLLM loaded"):
            from . import instrument_model

            try:
                self.handle = instrument_model(
                    model, vllm_config, mode=self.settings.mode, output_dir=self.settings.output_dir, window=self.settings.window,
                    failsafe=self.failsafe,
                )
            except NoMoELayersError as exc:
                log.info("moetrace: %s; not instrumented", exc)
                return
            log.info("moetrace: instrumented %s (%s)", type(model).__name__, self.handle)
            _patch_worker_warm_up(vllm_config, _on_engine_ready)
            if self.settings.control_port is not None:
                self._serve_control(vllm_config)
            if self.settings.dump_on_exit:
                atexit.register(self.on_exit)
                # vLLM's engine-core and worker processes are multiprocessing children, which
                # leave through os._exit (no atexit) after running multiprocessing's finalizers.
                multiprocessing.util.Finalize(None, self.on_exit, exitpriority=100)
        if not self.failsafe.on:
            self._close_control()

    def on_engine_ready(self, worker: Any = None) -> None:
        """Warm-up is over: follow ``worker``'s model runner's steps, start recording (``MOETRACE_AUTOSTART``); never raises."""
        if self.handle is None or not self.failsafe.on:
            return
        with self.failsafe.guarding("starting to record after vLLM's warm-up"):
            self._follow_steps(worker)
            if not self.settings.autostart or self.handle.recorder.recording:
                return
            self.handle.recorder.start_record()
            log.info("moetrace: recording (%s mode)", self.settings.mode)

    def _follow_steps(self, worker: Any) -> None:
        assert self.handle is not None
        batches, runner = self.handle.details.get("batches"), getattr(worker, "model_runner", None)
        if batches is None or runner is None or not hasattr(runner, "execute_model"):
            log.warning("moetrace: no vLLM model runner to follow in this worker; passes are recorded without their requests")
            return
        try:
            batches.attach(runner)
        except Exception:  # recording goes on; only the passes' requests are lost
            log.warning("moetrace: could not follow the model runner's steps; passes are recorded without their requests", exc_info=True)

    def _serve_control(self, vllm_config: Any) -> None:
        from moetrace.control import serve_control

        assert self.handle is not None and self.settings.control_port is not None
        rank = int(getattr(vllm_config.parallel_config, "rank", 0) or 0) if vllm_config is not None else 0
        port = self.settings.control_port + rank if self.settings.control_port else 0
        try:
            self.control = serve_control(self.handle.recorder, port=port, host=self.settings.control_host)
        except OSError:
            log.exception("moetrace: could not serve the control endpoint; recording goes on without it")
            return
        self.settings.output_dir.mkdir(parents=True, exist_ok=True)
        path = self.settings.output_dir / f"moetrace-control-{os.getpid()}.json"
        path.write_text(json.dumps({"url": self.control.url, "pid": os.getpid(), "rank": rank}))
        self.control_file = path
        log.info("moetrace: control endpoint at %s", self.control.url)

    def on_exit(self) -> None:
        """Close the control endpoint, dump what was recorded (once); never raises.

        Once a fault turned moetrace off, what this process recorded is discarded instead:
        the pass the fault hit is incomplete, and a trace is never written with one.
        """
        if self._exited:
            return
        self._exited = True
        with self.failsafe.guarding("the dump on exit"):
            self._close_control()
            if self.handle is None:
                return
            recorder = self.handle.recorder
            if not self.failsafe.on:
                if recorder.recording:
                    recorder.stop_record()
                recorder.reset()
                return
            if not self.settings.dump_on_exit:
                return
            try:
                if recorder.recording:
                    recorder.stop_record()
                if not recorder.undumped_passes:
                    return  # nothing recorded since the last dump (a streaming dump is a segment)
                self.dump_path = recorder.dump_record()
            except RecorderStateError:
                return  # never started: nothing to write
            log.info("moetrace: routing trace written to %s", self.dump_path)

    def _close_control(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None
        if self.control_file is not None:
            self.control_file.unlink(missing_ok=True)
            self.control_file = None


_session: WorkerSession | None = None


def current_session() -> WorkerSession | None:
    """This process's plugin session (``None`` unless the plugin is enabled and registered)."""
    return _session


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent; no-op unless ``MOETRACE_ENABLED=1``).

    Never raises into vLLM: a bad setting, a vLLM outside the supported range or a failed
    loader patch is one warning, and moetrace stays off in this process (its session says why).
    """
    global _session
    if _session is not None:
        return
    failsafe = FailSafe("this vLLM engine")
    with failsafe.guarding("moetrace's vLLM plugin start-up"):
        settings = PluginSettings.from_env(adapter="vllm")
        if not settings.enabled:
            return
        _session = WorkerSession(settings, failsafe)
        check_vllm_version()
        _patch_loaders(_on_model_loaded)
    if _session is None and not failsafe.on:  # the settings were wrong: remember it (one warning per process)
        _session = WorkerSession(PluginSettings(), failsafe)


def _on_model_loaded(model: Any, vllm_config: Any) -> None:
    """What the patched loaders call: this process's session, if there is one (found at call time)."""
    if _session is not None:
        _session.on_model_loaded(model, vllm_config)


def _on_engine_ready(worker: Any) -> None:
    """What the patched warm-up calls: this process's session, if there is one (found at call time)."""
    if _session is not None:
        _session.on_engine_ready(worker)


def _class_tree(base: type) -> list[type]:
    seen, stack = [], [base]
    while stack:
        cls = stack.pop()
        if cls not in seen:
            seen.append(cls)
            stack.extend(cls.__subclasses__())
    return seen


def _patch_loaders(on_loaded: Callable[[Any, Any], None]) -> None:
    """Wrap ``load_model`` of vLLM's model loaders so that ``on_loaded(model, vllm_config)`` sees each model."""
    import vllm.model_executor.model_loader  # noqa: F401  (imports every built-in loader)
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    for cls in _class_tree(BaseModelLoader):
        original = cls.__dict__.get("load_model")
        if original is not None and not getattr(original, _MARK, False):
            cls.load_model = _wrap_load(original, on_loaded)


def _wrap_load(original: Callable[..., Any], on_loaded: Callable[[Any, Any], None]) -> Callable[..., Any]:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(self, *args, **kwargs)
        on_loaded(model, kwargs.get("vllm_config", args[0] if args else None))
        return model

    return _marked(functools.update_wrapper(load_model, original))


def _patch_worker_warm_up(vllm_config: Any, on_ready: Callable[[Any], None]) -> None:
    """Run ``on_ready(worker)`` after the worker class's ``compile_or_warm_up_model`` returns (``None``: no such method)."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    worker_cls = getattr(getattr(vllm_config, "parallel_config", None), "worker_cls", None)
    cls = resolve_obj_by_qualname(worker_cls) if isinstance(worker_cls, str) else worker_cls
    original = getattr(cls, "compile_or_warm_up_model", None)
    if original is None:
        log.warning("moetrace: cannot tell when the worker %r has warmed up; recording starts now", worker_cls)
        on_ready(None)
        return
    if getattr(original, _MARK, False):
        return

    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        on_ready(self)
        return result

    cls.compile_or_warm_up_model = _marked(functools.update_wrapper(compile_or_warm_up_model, original))


def _marked(function: Callable[..., Any]) -> Callable[..., Any]:
    setattr(function, _MARK, True)
    return function
