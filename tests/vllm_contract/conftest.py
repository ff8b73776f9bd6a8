"""The vLLM contract check runs in one small virtualenv per vLLM release (the Makefile's `vllm-contract` block).

Its tests are collected wherever vLLM imports (the contract virtualenvs, and ``.venv-vllm``);
in the core ``.venv`` they are not, unless ``MOETRACE_REQUIRE_VLLM=1`` says this run is a vLLM
one: then a missing vLLM is an error, never a silent skip.
"""

from __future__ import annotations

from ..engines import uncollected_without

collect_ignore_glob = uncollected_without("vllm", "MOETRACE_REQUIRE_VLLM", ".venv-vllm")
