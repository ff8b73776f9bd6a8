"""The SGLang tests run in their own virtualenv (``make test`` calls ``.venv-sglang/bin/python -m pytest tests/sglang``).

Where SGLang is not installed (the main ``.venv``) they are not collected,
unless ``MOETRACE_REQUIRE_SGLANG=1`` says this run is the SGLang one: then a
missing SGLang is an error, never a silent skip.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("MOETRACE_REQUIRE_SGLANG") == "1":
        raise RuntimeError(
            "MOETRACE_REQUIRE_SGLANG=1 but SGLang is not importable in this interpreter; "
            "bootstrap the SGLang environment with `make .venv-sglang/.installed` and run "
            "`.venv-sglang/bin/python -m pytest tests/sglang`"
        )
    collect_ignore_glob = ["test_*.py"]
