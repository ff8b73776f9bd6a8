"""The SGLang tests run in their own virtualenv (``make test`` calls ``.venv-sglang/bin/python -m pytest tests/sglang``).

Where SGLang is not installed (the main ``.venv``) they are not collected,
unless ``MOETRACE_REQUIRE_SGLANG=1`` says this run is the SGLang one: then a
missing SGLang is an error, never a silent skip.
"""

from __future__ import annotations

from ..engines import uncollected_without

collect_ignore_glob = uncollected_without("sglang", "MOETRACE_REQUIRE_SGLANG", ".venv-sglang")
