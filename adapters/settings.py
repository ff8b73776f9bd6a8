"""The adapters' settings: one validated reader of the ``MOETRACE_*`` environment variables.

Every adapter reads its options here (the vLLM and SGLang plugins, and the ``instrument()`` of
Hugging Face, Megatron-Core, SGLang and vLLM); a bad value raises :class:`SettingsError` (a
``ValueError``) naming the variable and what it accepts, instead of a bare ``int()`` error deep
inside an engine.

=========================  ==========  ================================================
variable                   default     meaning
=========================  ==========  ================================================
``MOETRACE_ENABLED``       unset       ``1`` turns a plugin on (``0``/unset: off)
``MOETRACE_MODE``          ``stat``    (every adapter) recorder mode: ``stat``, ``per_pass``, ``per_token``
``MOETRACE_OUTPUT_DIR``    ``.``       (every adapter) where dumps (and control endpoint files) go
``MOETRACE_WINDOW``        ``1000``    (every adapter) passes kept in the ``stat`` window
``MOETRACE_AUTOSTART``     ``1``       (vLLM) start recording once the engine has warmed up
``MOETRACE_DUMP_ON_EXIT``  ``1``       (vLLM) dump what was recorded when the worker exits
``MOETRACE_CONTROL_PORT``  unset       (vLLM) serve the HTTP control endpoint on this port
``MOETRACE_CONTROL_HOST``  127.0.0.1   (vLLM) control endpoint bind address
``MOETRACE_TOP_K``         unset       (SGLang) experts per token when the model config lacks it
``MOETRACE_TIMING``        ``0``       (every adapter) phase timing inside the MoE layers
=========================  ==========  ================================================

Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case).

Every adapter reads this table, or refuses what it does not read: the four recorder variables
(``MOETRACE_MODE``, ``MOETRACE_OUTPUT_DIR``, ``MOETRACE_WINDOW``, ``MOETRACE_TIMING``) are the
defaults of the recorder any adapter builds (Hugging Face, Megatron-Core, SGLang, vLLM:
:func:`recorder_options`), and an explicit argument that says otherwise, or a recorder passed
in that is configured otherwise, is refused rather than either one silently winning. A variable
of the table that an adapter does not read (:data:`READ_BY`: ``MOETRACE_CONTROL_PORT`` under
Hugging Face) is refused. A refusal is a :class:`SettingsError`: one line naming the variable and
the fix; under an engine's plugin it is one warning without a traceback, and moetrace stays off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrace.config import MODES

__all__ = ["READ_BY", "RECORDER_VARIABLES", "PluginSettings", "SettingsError", "check_recorder_settings", "env_flag", "env_int", "recorder_options"]

#: The recorder's fields every adapter takes from the environment: variable -> RecorderConfig field.
RECORDER_VARIABLES = {"MOETRACE_MODE": "mode", "MOETRACE_OUTPUT_DIR": "output_dir", "MOETRACE_WINDOW": "window", "MOETRACE_TIMING": "timing"}

#: The variables of the table each adapter reads besides :data:`RECORDER_VARIABLES`; it refuses the others.
READ_BY = {
    "hf": frozenset(),
    "megatron": frozenset(),
    "sglang": frozenset({"MOETRACE_ENABLED", "MOETRACE_TOP_K"}),
    "vllm": frozenset({"MOETRACE_ENABLED", "MOETRACE_AUTOSTART", "MOETRACE_DUMP_ON_EXIT", "MOETRACE_CONTROL_PORT", "MOETRACE_CONTROL_HOST"}),
}

#: What each variable beyond the recorder's is for (the refusal says it).
_PURPOSE = {
    "MOETRACE_ENABLED": "the switch of the vLLM and SGLang plugins",
    "MOETRACE_AUTOSTART": "the vLLM plugin's start of recording after warm-up",
    "MOETRACE_DUMP_ON_EXIT": "the vLLM plugin's dump at exit",
    "MOETRACE_CONTROL_PORT": "the vLLM plugin's control endpoint (elsewhere: moetrace.control.serve_control)",
    "MOETRACE_CONTROL_HOST": "the vLLM plugin's control endpoint (elsewhere: moetrace.control.serve_control)",
    "MOETRACE_TOP_K": "SGLang's experts per token when its model config lacks it",
}


class SettingsError(ValueError):
    """A ``MOETRACE_*`` variable that is wrong, or set where it is not read; the message names it and the fix, in one line."""


def env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """Boolean variable ``name`` (``default`` when unset or empty).

    Raises:
        ValueError: not one of ``1/true/yes/on``, ``0/false/no/off``.
    """
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean; use 1 or 0")


def env_int(environ: Mapping[str, str], name: str, default: int | None, low: int) -> int | None:
    """Integer variable ``name`` of at least ``low`` (``default`` when unset or empty).

    Raises:
        ValueError: not an integer, or below ``low``.
    """
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer") from None
    if value < low:
        raise SettingsError(f"{name}={value} must be >= {low}")
    return value


@dataclass(frozen=True)
class PluginSettings:
    """A plugin's configuration, read from ``MOETRACE_*`` environment variables (table above)."""

    enabled: bool = False
    mode: str = "stat"
    output_dir: Path = Path(".")
    window: int = 1000
    autostart: bool = True
    dump_on_exit: bool = True
    control_port: int | None = None
    control_host: str = "127.0.0.1"
    top_k: int | None = None
    timing: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, force: bool = False, adapter: str | None = None) -> PluginSettings:
        """Parse the environment (the defaults when ``MOETRACE_ENABLED`` is off, unless ``force``:
        an explicit ``instrument()`` reads the options whatever the switch says); ``adapter``
        (a plugin starting): also refuse the variables it does not read (:data:`READ_BY`).

        Raises:
            SettingsError: naming the variable that is wrong.
        """
        env = os.environ if environ is None else environ
        enabled = env_flag(env, "MOETRACE_ENABLED", False)
        if not (enabled or force):
            return cls()
        if adapter is not None:
            _refuse_unread(adapter, env)
        return cls(
            enabled=enabled,
            **_recorder_values(env),
            autostart=env_flag(env, "MOETRACE_AUTOSTART", True),
            dump_on_exit=env_flag(env, "MOETRACE_DUMP_ON_EXIT", True),
            control_port=env_int(env, "MOETRACE_CONTROL_PORT", None, 0),
            control_host=env.get("MOETRACE_CONTROL_HOST") or "127.0.0.1",
            top_k=env_int(env, "MOETRACE_TOP_K", None, 1),
        )


def _recorder_values(env: Mapping[str, str], only_set: bool = False) -> dict[str, Any]:
    """The recorder fields of :data:`RECORDER_VARIABLES` read from ``env`` (``only_set``: those whose variable is set)."""
    mode = env.get("MOETRACE_MODE") or "stat"
    if mode not in MODES:
        raise SettingsError(f"MOETRACE_MODE={mode!r} is not one of {', '.join(MODES)}")
    values = {"mode": mode, "output_dir": Path(env.get("MOETRACE_OUTPUT_DIR") or "."), "window": env_int(env, "MOETRACE_WINDOW", 1000, 1) or 1000,
              "timing": env_flag(env, "MOETRACE_TIMING", False)}
    return {field: values[field] for variable, field in RECORDER_VARIABLES.items() if not only_set or env.get(variable)}


def _refuse_unread(adapter: str, env: Mapping[str, str]) -> None:
    """Refuse a variable of the table that ``adapter`` does not read (set and not empty)."""
    for variable, purpose in _PURPOSE.items():
        if env.get(variable) and variable not in READ_BY[adapter]:
            raise SettingsError(f"{variable}={env[variable]!r} is set, but the {adapter} adapter does not read it (it is {purpose}); unset it")


def recorder_options(adapter: str, explicit: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The options ``adapter`` builds its recorder with: the recorder variables that are set, with the
    caller's ``explicit`` RecorderConfig fields beside them.

    Raises:
        SettingsError: a variable is wrong, not read by ``adapter``, or disagrees with an explicit argument.
    """
    env = os.environ if environ is None else environ
    _refuse_unread(adapter, env)
    from_env = _recorder_values(env, only_set=True)
    for variable, field in RECORDER_VARIABLES.items():
        if field in from_env and field in explicit and _same(field, explicit[field]) != from_env[field]:
            raise SettingsError(f"{variable}={env[variable]!r} and the argument {field}={explicit[field]!r} disagree; drop one of them")
    return {**from_env, **explicit}


def check_recorder_settings(adapter: str, config: Any, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a recorder variable that the recorder ``adapter`` was given (its ``config``) does not follow.

    Raises:
        SettingsError: naming the variable, the recorder's value and the fix.
    """
    env = os.environ if environ is None else environ
    _refuse_unread(adapter, env)
    for field, value in _recorder_values(env, only_set=True).items():
        if _same(field, getattr(config, field)) != value:
            variable = next(v for v, f in RECORDER_VARIABLES.items() if f == field)
            raise SettingsError(f"{variable}={env[variable]!r}, but the recorder given to instrument() has {field}={getattr(config, field)!r}; "
                                f"configure that recorder with {field}={value!r} or unset {variable}")


def _same(field: str, value: Any) -> Any:
    """``value`` as the environment's value of ``field`` is compared with it (a folder as a Path)."""
    return Path(value) if field == "output_dir" else value
