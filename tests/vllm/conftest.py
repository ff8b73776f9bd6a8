"""The vLLM tests run in their own virtualenv (``make test`` calls ``.venv-vllm/bin/python -m pytest tests/vllm``).

Where vLLM is not installed (the main ``.venv``) they are not collected, unless
``MOETRACE_REQUIRE_VLLM=1`` says this run is the vLLM one: then a missing vLLM
is an error, never a silent skip.
"""

from __future__ import annotations

from ..engines import uncollected_without

collect_ignore_glob = uncollected_without("vllm", "MOETRACE_REQUIRE_VLLM", ".venv-vllm")
