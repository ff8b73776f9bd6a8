"""The vLLM tests run in their own virtualenv (``make test`` calls ``.venv-vllm/bin/python -m pytest tests/vllm``).

Where vLLM is not installed (the main ``.venv``) they are not collected, unless
``MOETRACE_REQUIRE_VLLM=1`` says this run is the vLLM one: then a missing vLLM
is an error, never a silent skip.
"""

from __future__ import annotations

import importlib.util
import os

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("MOETRACE_REQUIRE_VLLM") == "1":
        raise RuntimeError(
            "MOETRACE_REQUIRE_VLLM=1 but vLLM is not importable in this interpreter; "
            "bootstrap the vLLM environment with `make .venv-vllm/.installed` and run "
            "`.venv-vllm/bin/python -m pytest tests/vllm`"
        )
    collect_ignore_glob = ["test_*.py"]
