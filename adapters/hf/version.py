"""The transformers versions the Hugging Face adapter supports, and the check both hooks and replay run."""

from __future__ import annotations

from ..base import UnsupportedVersionError

__all__ = ["MIN_TRANSFORMERS", "check_transformers", "installed_version"]

MIN_TRANSFORMERS = (5, 0)
"""Oldest transformers whose MoE families use the shared experts machinery this adapter relies on."""


def installed_version() -> str:
    """The version string of the installed transformers."""
    import transformers

    return str(transformers.__version__)


def check_transformers(installed: str) -> None:
    """Refuse a transformers release older than :data:`MIN_TRANSFORMERS`.

    Raises:
        UnsupportedVersionError: naming ``installed`` and the upgrade to run.
    """
    version = tuple(int(p) for p in installed.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        raise UnsupportedVersionError(
            f"transformers {installed} is older than {'.'.join(map(str, MIN_TRANSFORMERS))}, "
            "whose MoE families share the @use_experts_implementation experts modules this adapter hooks; "
            "upgrade transformers (pip install 'moetrace[hf]')"
        )
