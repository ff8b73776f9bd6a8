"""Start and stop a real vLLM engine on a tiny checkpoint (CPU, eager, bf16, offline)."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..engines import environment
from .checkpoints import prompt

__all__ = ["GENERATION", "PROMPTS", "sampling_params", "start_llm", "stop_llm"]

PROMPTS = [prompt(3, 7, 1, 9, 4), prompt(12, 5, 8), prompt(20, 21, 22, 23, 24, 25, 26)]
"""Three prompts of 5, 3 and 7 tokens."""

GENERATION = dict(max_tokens=5, temperature=0.0, ignore_eos=True)


def start_llm(checkpoint: Path, env: Mapping[str, str], **options: Any) -> Any:
    """``vllm.LLM`` on ``checkpoint`` with ``env`` set while the engine starts (then restored); ``options`` go to ``vllm.LLM``."""
    import vllm
    import vllm.envs

    with environment({"HF_HUB_OFFLINE": "1", **env}):
        vllm.envs.disable_envs_cache()  # an earlier in-process engine froze the env it read
        return vllm.LLM(
            model=str(checkpoint), enforce_eager=True, dtype="bfloat16", max_model_len=256, seed=0,
            kv_cache_memory_bytes=64 << 20, **options,
        )


def stop_llm(llm: Any, timeout: float = 120.0) -> None:
    """Shut the engine down and free the process-wide state an in-process engine set up.

    ``timeout``: how long an engine-core process may take to exit before vLLM
    kills it (a loaded CI machine needs more than vLLM's default 5 s).
    """
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown(timeout=timeout)
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def sampling_params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(**GENERATION)
