"""The engine plugins' settings: one validated reader of the ``MOETRACE_*`` environment variables.

The vLLM and SGLang plugins (and an explicit ``instrument()`` of either) read
their options here; a bad value raises ``ValueError`` naming the variable and
what it accepts, instead of a bare ``int()`` error deep inside an engine.

=========================  ==========  ================================================
variable                   default     meaning
=========================  ==========  ================================================
``MOETRACE_ENABLED``       unset       ``1`` turns a plugin on (``0``/unset: off)
``MOETRACE_MODE``          ``stat``    recorder mode: ``stat``, ``per_pass``, ``per_token``
``MOETRACE_OUTPUT_DIR``    ``.``       where dumps (and control endpoint files) go
``MOETRACE_WINDOW``        ``1000``    passes kept in the ``stat`` window
``MOETRACE_AUTOSTART``     ``1``       (vLLM) start recording once the engine has warmed up
``MOETRACE_DUMP_ON_EXIT``  ``1``       (vLLM) dump what was recorded when the worker exits
``MOETRACE_CONTROL_PORT``  unset       (vLLM) serve the HTTP control endpoint on this port
``MOETRACE_CONTROL_HOST``  127.0.0.1   (vLLM) control endpoint bind address
``MOETRACE_TOP_K``         unset       (SGLang) experts per token when the model config lacks it
``MOETRACE_TIMING``        ``0``       (SGLang) phase timing inside the MoE layers
=========================  ==========  ================================================

Booleans accept ``1/true/yes/on`` and ``0/false/no/off`` (any case).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moetrace.config import MODES

__all__ = ["PluginSettings", "env_flag", "env_int"]


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
    raise ValueError(f"{name}={raw!r} is not a boolean; use 1 or 0")


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
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < low:
        raise ValueError(f"{name}={value} must be >= {low}")
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
    def from_env(cls, environ: Mapping[str, str] | None = None, force: bool = False) -> PluginSettings:
        """Parse the environment (the defaults when ``MOETRACE_ENABLED`` is off, unless ``force``:
        an explicit ``instrument()`` reads the options whatever the switch says).

        Raises:
            ValueError: naming the variable that is wrong.
        """
        env = os.environ if environ is None else environ
        enabled = env_flag(env, "MOETRACE_ENABLED", False)
        if not (enabled or force):
            return cls()
        mode = env.get("MOETRACE_MODE") or "stat"
        if mode not in MODES:
            raise ValueError(f"MOETRACE_MODE={mode!r} is not one of {MODES}")
        return cls(
            enabled=enabled,
            mode=mode,
            output_dir=Path(env.get("MOETRACE_OUTPUT_DIR") or "."),
            window=env_int(env, "MOETRACE_WINDOW", 1000, 1) or 1000,
            autostart=env_flag(env, "MOETRACE_AUTOSTART", True),
            dump_on_exit=env_flag(env, "MOETRACE_DUMP_ON_EXIT", True),
            control_port=env_int(env, "MOETRACE_CONTROL_PORT", None, 0),
            control_host=env.get("MOETRACE_CONTROL_HOST") or "127.0.0.1",
            top_k=env_int(env, "MOETRACE_TOP_K", None, 1),
            timing=env_flag(env, "MOETRACE_TIMING", False),
        )
