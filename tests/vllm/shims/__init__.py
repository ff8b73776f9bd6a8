"""Test-harness shims for vLLM's CPU engine (see each module)."""
