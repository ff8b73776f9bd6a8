"""The Megatron-Core tests run in their own virtualenv (``make test`` calls ``.venv-megatron/bin/python -m pytest tests/megatron``).

Where Megatron-Core is not installed (the main ``.venv``) they are not collected,
unless ``MOETRACE_REQUIRE_MEGATRON=1`` says this run is the Megatron one: then a
missing Megatron-Core is an error, never a silent skip. Each test launches fresh
gloo ranks on a free port (:func:`moetrace.reference.launcher.launch`); the CPU
stand-ins for Megatron's CUDA-only calls are in :mod:`tests.megatron.shims`.
"""

from __future__ import annotations

from ..engines import uncollected_without

collect_ignore_glob = uncollected_without("megatron", "MOETRACE_REQUIRE_MEGATRON", ".venv-megatron")
