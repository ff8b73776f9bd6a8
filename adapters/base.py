"""The shape every engine adapter shares: a handle, matched hook add/remove, recorder set-up.

An adapter's ``instrument(target, recorder=None, capturer=None, **options)``
finds the MoE layers of ``target``, then:

1. :func:`existing_instrumentation` — returns the live handle when ``target``
   is already instrumented with the same recorder (instrumenting twice is
   harmless), or raises :class:`AlreadyInstrumentedError` for another one;
2. :func:`resolve_recorder` — checks a given recorder against the model's
   geometry, or builds one from ``(num_layers, num_experts, top_k,
   layer_ids)`` and installs it as the process-wide recorder;
3. registers every hook through one :class:`HookRegistry` (each add keeps
   its own undo, the way accelerate's ``add_hook_to_module`` /
   ``remove_hook_from_module`` pair up); if anything fails half-way the
   registry is unwound, so a model is never left half-instrumented;
4. returns an :class:`Instrumentation` whose ``uninstrument()`` removes every
   hook in reverse order and forgets the target.

Every hook that runs inside the engine's calls is guarded by the
instrumentation's :class:`~moetrace.adapters.failsafe.FailSafe`
(``Instrumentation.failsafe``): a fault in it turns moetrace off for that
engine with one warning, and the engine's call goes on (:mod:`.failsafe` draws
the line between what is raised to a caller and what never reaches the engine).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moetrace.batch import PassBatch
from moetrace.config import RecorderConfig
from moetrace.process_recorder import NoOpRecorder, Recorder, get_recorder, set_recorder
from moetrace.recorder import ExpertDistributionRecorder

from .failsafe import FailSafe
from .settings import check_recorder_settings, recorder_options

__all__ = [
    "AdapterError",
    "AlreadyInstrumentedError",
    "HookRegistry",
    "Instrumentation",
    "NoMoELayersError",
    "RecorderBinding",
    "UnsupportedVersionError",
    "build_recorder",
    "check_recorder",
    "existing_instrumentation",
    "forward_pass_wrapper",
    "live_instrumentation",
    "recorder_scope",
    "refuse_capturer",
    "resolve_recorder",
    "unwinding",
]


class AdapterError(RuntimeError):
    """An engine cannot be instrumented as asked; the message says what to do."""


class NoMoELayersError(AdapterError, ValueError):
    """The target has no MoE layer the adapter knows how to observe."""


class UnsupportedVersionError(AdapterError):
    """The installed engine version is outside the range the adapter was written against."""


class AlreadyInstrumentedError(AdapterError):
    """The target is already instrumented with a different recorder or capturer."""


# ---------------------------------------------------------------------------- hooks


class HookRegistry:
    """Hooks and patches added to an engine, each paired with the undo that removes it.

    Every ``add``/``patch`` call records its undo; :meth:`remove_all` runs the
    undos in reverse order, so a wrapper added on top of another is removed
    first. A patch whose attribute was replaced by someone else in the
    meantime is not clobbered: it is reported (warning) and left alone.
    """

    def __init__(self) -> None:
        self._undo: list[tuple[str, Callable[[], str | None]]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def forward_pre_hook(self, module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> None:
        """``module.register_forward_pre_hook(hook)``, removed by :meth:`remove_all`."""
        handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
        self._push(f"forward pre-hook on {type(module).__name__}", _removing(handle))

    def forward_hook(self, module: torch.nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False) -> None:
        """``module.register_forward_hook(hook)``, removed by :meth:`remove_all`."""
        handle = module.register_forward_hook(hook, with_kwargs=with_kwargs)
        self._push(f"forward hook on {type(module).__name__}", _removing(handle))

    def wrap_forward(self, module: torch.nn.Module, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replace ``module.forward`` (instance attribute) by ``wrapper(original_forward)``.

        The original is restored exactly: an instance attribute that existed
        before is put back, otherwise the attribute is deleted so that the
        class's ``forward`` shows through again.
        """
        had_own = "forward" in module.__dict__
        original = module.__dict__.get("forward")
        wrapped = functools.update_wrapper(wrapper(module.forward), module.forward)

        def undo() -> str | None:
            if module.__dict__.get("forward") is not wrapped:
                return f"{type(module).__name__}.forward was replaced by someone else after moetrace wrapped it; left as is"
            if had_own:
                module.forward = original
            else:
                del module.forward
            return None

        module.forward = wrapped
        self._push(f"forward wrapper on {type(module).__name__}", undo)

    def patch(self, owner: Any, name: str, value: Any) -> Any:
        """``setattr(owner, name, value)``; returns the previous raw value, restored by :meth:`remove_all`.

        The raw attribute is read from ``owner.__dict__`` (so a class's
        ``staticmethod``/``classmethod`` wrapper is put back as it was); an
        attribute the owner only inherited is deleted again on removal.
        """
        own = vars(owner)
        had_own = name in own
        original = own[name] if had_own else getattr(owner, name)

        def undo() -> str | None:
            if vars(owner).get(name) is not value:
                return f"{_name(owner)}.{name} was replaced by someone else after moetrace patched it; left as is"
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
            return None

        setattr(owner, name, value)
        self._push(f"patch of {_name(owner)}.{name}", undo)
        return original

    def on_remove(self, what: str, undo: Callable[[], str | None]) -> None:
        """Register any other undo (returns a problem description or ``None``)."""
        self._push(what, undo)

    def remove_all(self) -> list[str]:
        """Undo everything, newest first. Returns the problems met (also warned)."""
        problems: list[str] = []
        while self._undo:
            what, undo = self._undo.pop()
            try:
                problem = undo()
            except Exception as exc:  # keep unwinding: the rest must still be removed
                problem = f"removing the {what} failed: {exc!r}"
            if problem:
                problems.append(problem)
                warnings.warn(f"moetrace: {problem}", RuntimeWarning, stacklevel=3)
        return problems

    def _push(self, what: str, undo: Callable[[], str | None]) -> None:
        self._undo.append((what, undo))


def _removing(handle: torch.utils.hooks.RemovableHandle) -> Callable[[], None]:
    def undo() -> None:
        handle.remove()

    return undo


def _name(owner: Any) -> str:
    return getattr(owner, "__name__", type(owner).__name__)


def forward_pass_wrapper(
    recorder: Recorder,
    failsafe: FailSafe,
    batch_of: Callable[[tuple[Any, ...], dict[str, Any]], PassBatch | None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A :meth:`HookRegistry.wrap_forward` wrapper that runs each call inside ``recorder.with_forward_pass()``.

    Re-entrant calls (a forward calling itself, or the same wrapper reached
    twice) open one pass only. ``batch_of(args, kwargs)`` gives the pass's batch
    (:class:`~moetrace.batch.PassBatch`, from host values) when it is known.
    Opening or closing the pass runs behind ``failsafe`` (:meth:`FailSafe.around`):
    it never fails the forward.
    """

    def wrap(forward: Callable[..., Any]) -> Callable[..., Any]:
        depth = 0

        @contextlib.contextmanager
        def in_pass(*args: Any, **kwargs: Any) -> Iterator[None]:
            nonlocal depth
            if depth:
                yield
                return
            depth += 1
            try:
                with recorder.with_forward_pass(batch=batch_of(args, kwargs) if batch_of is not None else None):
                    yield
            finally:
                depth -= 1

        return failsafe.around(forward, in_pass, "the forward-pass wrapper")

    return wrap


def recorder_scope(recorder: Recorder, layer: int | None = None, phase: str | None = None) -> Callable[..., contextlib.AbstractContextManager[Any]]:
    """A scope for :meth:`FailSafe.around` that ignores the call's arguments and enters
    ``recorder.with_current_layer(layer)`` (when given), then ``recorder.with_phase(phase)`` (when given)."""

    @contextlib.contextmanager
    def scope(*args: Any, **kwargs: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if layer is not None:
                stack.enter_context(recorder.with_current_layer(layer))
            if phase is not None:
                stack.enter_context(recorder.with_phase(phase))
            yield

    return scope


# ---------------------------------------------------------------------------- recorder


@dataclass(frozen=True)
class RecorderBinding:
    """The recorder an instrumentation counts into, and whether ``instrument`` created it."""

    recorder: ExpertDistributionRecorder
    created: bool
    previous_global: Recorder | None

    def rollback(self) -> None:
        """Undo the global install (when ``instrument`` fails after building the recorder)."""
        if self.created and self.previous_global is not None and get_recorder() is self.recorder:
            set_recorder(self.previous_global)


def build_recorder(
    num_layers: int,
    num_experts: int,
    top_k: int,
    layer_ids: Sequence[int],
    **options: Any,
) -> ExpertDistributionRecorder:
    """A recorder for ``num_layers`` MoE layers (model layer indices ``layer_ids``).

    ``options`` are any other :class:`~moetrace.config.RecorderConfig` fields
    (``mode``, ``device``, ``output_dir``, ``hidden_size``, ``model``, ...).
    """
    fields = {f for f in RecorderConfig.__dataclass_fields__}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise TypeError(f"unknown recorder option(s) {unknown}; valid ones are RecorderConfig fields: {sorted(fields)}")
    config = RecorderConfig(
        num_layers=num_layers,
        num_physical_experts=num_experts,
        top_k=top_k,
        layer_ids=tuple(layer_ids),
        **options,
    )
    return ExpertDistributionRecorder(config)


def check_recorder(recorder: object, num_layers: int, num_experts: int, top_k: int) -> ExpertDistributionRecorder:
    """Raise a clear error unless ``recorder`` can count this model's routing."""
    if isinstance(recorder, NoOpRecorder):
        raise AdapterError(
            "the recorder given is the no-op default, which records nothing; pass recorder=None to let "
            "instrument() build one from the model's config, or call moetrace.configure(...) first"
        )
    if not isinstance(recorder, ExpertDistributionRecorder):
        raise TypeError(f"recorder must be a moetrace ExpertDistributionRecorder, got {type(recorder).__name__}")
    cfg = recorder.config
    problems = []
    if cfg.num_layers != num_layers:
        problems.append(f"num_layers={cfg.num_layers} but the model has {num_layers} MoE layers")
    if cfg.top_k != top_k:
        problems.append(f"top_k={cfg.top_k} but the model routes each token to {top_k} experts")
    if cfg.num_physical_experts < num_experts:
        problems.append(f"num_physical_experts={cfg.num_physical_experts} but the model has {num_experts} experts")
    if problems:
        raise ValueError(
            "the recorder does not fit this model: " + "; ".join(problems)
            + ". Pass recorder=None to build a matching one, or configure it with these values"
        )
    return recorder


def resolve_recorder(
    recorder: object | None,
    num_layers: int,
    num_experts: int,
    top_k: int,
    layer_ids: Sequence[int],
    *,
    adapter: str,
    install: bool = True,
    defaults: dict[str, Any] | None = None,
    **options: Any,
) -> RecorderBinding:
    """Use ``recorder`` (checked against the geometry) or build one and install it globally.

    With ``recorder=None`` a new recorder is built from the geometry,
    ``options`` (user-given :class:`~moetrace.config.RecorderConfig` fields)
    and ``defaults`` (adapter-derived fields such as ``engine``, ``model``,
    ``hidden_size``, overridden by ``options``) and, with ``install=True``,
    installed with :func:`moetrace.set_recorder`; replacing a global recorder
    that is recording is warned about (its data stays in that object).
    The ``MOETRACE_*`` recorder variables are read for ``adapter`` (``"hf"``, ``"megatron"``, ``"sglang"``,
    ``"vllm"``): the defaults of a recorder built here, and checked against a recorder given
    (:mod:`moetrace.adapters.settings`).
    """
    if recorder is not None:
        if options:
            raise TypeError(f"recorder options {sorted(options)} were given together with a recorder; configure the recorder instead")
        if hasattr(recorder, "config"):
            check_recorder_settings(adapter, recorder.config)
        return RecorderBinding(check_recorder(recorder, num_layers, num_experts, top_k), created=False, previous_global=None)
    built = build_recorder(num_layers, num_experts, top_k, layer_ids, **{**(defaults or {}), **recorder_options(adapter, options)})
    if not install:
        return RecorderBinding(built, created=True, previous_global=None)
    previous = set_recorder(built)
    if previous.recording:
        warnings.warn(
            "moetrace: instrument() installed a new global recorder while the previous one was recording; "
            "pass recorder=moetrace.get_recorder() to keep counting into the configured one",
            RuntimeWarning,
            stacklevel=3,
        )
    return RecorderBinding(built, created=True, previous_global=previous)


# ---------------------------------------------------------------------------- handle

_LIVE: weakref.WeakKeyDictionary[Any, Instrumentation] = weakref.WeakKeyDictionary()


class Instrumentation:
    """A live instrumentation of one target; ``uninstrument()`` removes every hook.

    Attributes:
        target: what was instrumented (a model, an engine module, ...).
        recorder: the recorder the hooks count into (``None`` until the engine
            builds its model, for adapters that attach before that: SGLang).
        layer_ids: model layer index of each recorded MoE layer ``[L]``
            (compact MoE layer ``i`` is model layer ``layer_ids[i]``).
        capturer: the per-request capturer fed by the hooks, or ``None``.
        engine: ``"hf"``, ``"sglang"``, ``"vllm"``.
        details: adapter-specific description (e.g. how each layer is hooked).
        failsafe: the switch the hooks run behind (``failsafe.on`` is false, and
            ``failsafe.error`` says why, once a fault turned moetrace off).
    """

    def __init__(
        self,
        target: Any,
        recorder: ExpertDistributionRecorder | None,
        layer_ids: Sequence[int],
        hooks: HookRegistry,
        *,
        engine: str,
        capturer: Any = None,
        details: dict[str, Any] | None = None,
        failsafe: FailSafe | None = None,
    ) -> None:
        self.target = target
        self.recorder = recorder
        self.layer_ids: tuple[int, ...] = tuple(int(i) for i in layer_ids)
        self.capturer = capturer
        self.engine = engine
        self.details: dict[str, Any] = dict(details or {})
        self.failsafe = failsafe if failsafe is not None else FailSafe(engine)
        self._hooks = hooks
        self._active = True
        _LIVE[target] = self

    @property
    def active(self) -> bool:
        """False once :meth:`uninstrument` ran."""
        return self._active

    @property
    def num_hooks(self) -> int:
        """Hooks and patches currently installed by this instrumentation."""
        return len(self._hooks)

    def uninstrument(self) -> list[str]:
        """Remove every hook and patch (newest first); calling it again does nothing.

        Returns the problems met (each also warned), e.g. a patched function
        that someone else replaced in the meantime and that was left alone.
        The recorder keeps what it recorded and stays installed globally.
        """
        if not self._active:
            return []
        self._active = False
        if _LIVE.get(self.target) is self:
            del _LIVE[self.target]
        return self._hooks.remove_all()

    def __enter__(self) -> Instrumentation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstrument()

    def __repr__(self) -> str:
        state = "active" if self._active else "removed"
        return f"<Instrumentation {self.engine} {state}: {len(self.layer_ids)} MoE layers {list(self.layer_ids)}, {self.num_hooks} hooks>"


def refuse_capturer(capturer: Any, engine: str, instead: str) -> None:
    """Refuse a capturer given to an adapter that feeds none (``engine``'s name), saying what to use ``instead``."""
    if capturer is not None:
        raise AdapterError(f"the {engine} adapter does not feed a moetrace capturer: {instead}; pass capturer=None")


def existing_instrumentation(target: Any, recorder: object | None = None, capturer: Any = None) -> Instrumentation | None:
    """The live handle on ``target`` when instrumenting it again would change nothing.

    Returns ``None`` when ``target`` is not instrumented. Raises
    :class:`AlreadyInstrumentedError` when it is, with a different recorder
    or capturer than the ones asked for (``None`` means "whatever is there").
    """
    live = _LIVE.get(target)
    if live is None or not live.active:
        return None
    if recorder is not None and recorder is not live.recorder:
        raise AlreadyInstrumentedError(
            f"{type(target).__name__} is already instrumented by moetrace with another recorder; call "
            "uninstrument() on the handle returned by the first instrument() (or moetrace.adapters."
            "uninstrument(target)) before instrumenting it again"
        )
    if capturer is not None and capturer is not live.capturer:
        raise AlreadyInstrumentedError(
            f"{type(target).__name__} is already instrumented by moetrace with another capturer; "
            "uninstrument() it first"
        )
    return live


def live_instrumentation(target: Any) -> Instrumentation | None:
    """The active instrumentation of ``target``, if any."""
    return _LIVE.get(target)


@contextlib.contextmanager
def unwinding(hooks: HookRegistry, binding: RecorderBinding | None = None) -> Iterator[HookRegistry]:
    """If the block raises, remove what ``hooks`` holds and undo ``binding``'s global install.

    Wrap the part of ``instrument`` that adds hooks in it: a target is never
    left half-instrumented.
    """
    try:
        yield hooks
    except BaseException:
        hooks.remove_all()
        if binding is not None:
            binding.rollback()
        raise
