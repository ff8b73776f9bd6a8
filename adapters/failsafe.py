"""An observer never stops what it observes: the switch every hook and plugin step of an engine runs behind.

Where the line is. moetrace code runs in two kinds of places:

- **Called by you** (``instrument()``, ``uninstrument()``, a recorder's methods,
  ``replay()``): errors are raised to you, with a message that names the value
  and the fix (an :class:`~moetrace.adapters.base.AdapterError` for a target
  that cannot be instrumented, the recorder's argument checks, ...).
- **Called by the engine** (plugin entry points, the patched model loader and
  warm-up, the dump at exit, and every hook, tap and wrapper that runs inside a
  forward pass): nothing moetrace raises there may reach the engine. The first
  exception trips the engine's :class:`FailSafe`: one warning (logger
  ``moetrace.adapters``, naming the engine, the step and the error, with its
  traceback; a bad ``MOETRACE_*`` setting, :class:`~moetrace.adapters.settings.SettingsError`,
  is one line without one), moetrace is off for that engine from then on (every guarded hook
  is a pass-through; nothing is uninstalled from inside a forward, and
  ``uninstrument()`` still removes every hook), and the engine's call goes on
  with its own arguments and result. What the engine's own code raises inside a
  guarded call is the engine's, and propagates unchanged.

Two kinds of errors pass a guard on purpose: the checks of
:mod:`moetrace.testing` (:class:`~moetrace.testing.HostSyncError`,
:class:`~moetrace.testing.GraphCaptureError`), which a test turns on to fail
when a hook breaks the hot-path contract, and anything that is not an
``Exception`` (``KeyboardInterrupt``, ``SystemExit``). Replay hooks are outside
the line on purpose: they change what the model
computes, so a replay that cannot force its routes fails loudly instead of
letting the model silently route another way.

Cost. A guarded tap or hook (:meth:`FailSafe.guard`, what runs in every MoE
layer) adds one attribute read (``on``) and a ``try`` block (zero-cost in
CPython 3.11 when nothing is raised): no allocation, no tensor operation, no
host-device synchronisation, so it is as CUDA-graph safe as the hook it guards.
A guarded wrapper (:meth:`FailSafe.around`, :meth:`FailSafe.entered`: once per
pass, or per timed phase) adds the small host objects of one more context
manager, as the recorder's own scopes do. The switch is host state; turning it
off needs no re-capture.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from moetrace.testing import GraphCaptureError, HostSyncError

from .settings import SettingsError

__all__ = ["FailSafe"]

T = TypeVar("T")

log = logging.getLogger("moetrace.adapters")

_CHECKS = (HostSyncError, GraphCaptureError)
"""What a test's hot-path check raises inside a hook: let through, so that the test fails."""


class FailSafe:
    """One engine's moetrace switch: on until the first exception moetrace meets inside the engine's calls.

    Args:
        engine: what moetrace observes, as the warning names it (``"this vLLM engine"``).

    Attributes:
        on: whether moetrace still observes this engine.
        error: what turned it off (``"<step>: <Type>: <message>"``), ``None`` while on.
    """

    __slots__ = ("engine", "error", "on")

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.on = True
        self.error: str | None = None

    def trip(self, exc: BaseException, where: str) -> None:
        """Turn moetrace off after ``exc`` met in ``where``; the first call warns, later ones change nothing.

        A hot-path check of :mod:`moetrace.testing` is raised again instead (a test asked for it).
        """
        if isinstance(exc, _CHECKS):
            raise exc
        if not self.on:
            return
        self.on = False
        self.error = f"{where}: {type(exc).__name__}: {exc}"
        if isinstance(exc, SettingsError):  # the user's setting, named with its fix: one line, no traceback
            log.warning("moetrace: %s: %s; moetrace is off for %s, which goes on without it", where, exc, self.engine)
            return
        log.warning(
            "moetrace: %s failed (%s: %s); moetrace is off for %s, which goes on without it",
            where, type(exc).__name__, exc, self.engine, exc_info=exc,
        )

    def guard(self, function: Callable[..., T], where: str) -> Callable[..., T | None]:
        """``function`` as a hook the engine calls: ``None`` (and no call) once off; an exception trips the switch
        and gives ``None``. For observers whose result the engine ignores (taps, pre-hooks returning ``None``)."""

        def guarded(*args: Any, **kwargs: Any) -> T | None:
            if self.on:
                try:
                    return function(*args, **kwargs)
                except Exception as exc:
                    self.trip(exc, where)
            return None

        return guarded

    def around(self, original: Callable[..., T], scope: Callable[..., contextlib.AbstractContextManager[Any]], where: str) -> Callable[..., T]:
        """``original`` (the engine's callable) run inside moetrace's ``scope(*args, **kwargs)`` (:meth:`entered`);
        once off, ``original`` is called directly."""

        def call(*args: Any, **kwargs: Any) -> T:
            if not self.on:
                return original(*args, **kwargs)
            with self.entered(lambda: scope(*args, **kwargs), where):
                return original(*args, **kwargs)

        return call

    @contextlib.contextmanager
    def entered(self, make: Callable[[], contextlib.AbstractContextManager[Any]], where: str) -> Iterator[None]:
        """moetrace's scope ``make()`` around a block of the engine's code.

        Making, entering or leaving the scope may fail: the switch trips and the
        block runs (or has run) as it would without it. What the block raises
        propagates (the scope is left with it first). Once off, only the block runs.
        """
        if not self.on:
            yield
            return
        try:
            context = make()
            context.__enter__()
        except Exception as exc:
            self.trip(exc, where)
            yield
            return
        try:
            yield
        except BaseException as exc:
            self._leave(context, exc, where)
            raise
        self._leave(context, None, where)

    def _leave(self, context: contextlib.AbstractContextManager[Any], exc: BaseException | None, where: str) -> None:
        try:
            context.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)
        except Exception as error:
            if error is not exc:
                self.trip(error, where)

    @contextlib.contextmanager
    def guarding(self, where: str) -> Iterator[None]:
        """A block of a plugin step (not a hot path): an exception in it trips the switch instead of propagating."""
        try:
            yield
        except Exception as exc:
            self.trip(exc, where)

    def __repr__(self) -> str:
        return f"<FailSafe {self.engine} {'on' if self.on else 'off: ' + str(self.error)}>"
