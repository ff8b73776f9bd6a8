"""Start and stop a real SGLang engine on the tiny checkpoint (CPU, torch-native attention, token ids in)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from ..engines import environment

__all__ = ["CPU_ENV", "ENGINE_ARGS", "GENERATION", "PROMPTS", "engine"]

PROMPTS = [[3, 7, 1, 9, 4], [12, 5, 8], [20, 21, 22, 23, 24, 25, 26]]
"""Three prompts of 5, 3 and 7 token ids."""

GENERATION = dict(max_new_tokens=4, temperature=0.0, ignore_eos=True)

CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}
"""What SGLang's CPU engine needs in every process (the shims in tests/sglang/shims do the rest)."""

ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", attention_backend="torch_native", skip_tokenizer_init=True, disable_cuda_graph=True,
    mem_fraction_static=0.05, max_total_tokens=512, chunked_prefill_size=64, dtype="float32",
)
"""The smallest engine that runs here; shared by ``sglang.Engine`` and ``sglang.launch_server``."""


@contextlib.contextmanager
def engine(model_path: str, env: Mapping[str, str], **engine_args: Any) -> Iterator[Any]:
    """A running ``sglang.Engine`` with ``env`` set for it and its processes; shut down on exit."""
    import sglang

    with environment({**CPU_ENV, **env}):
        llm = sglang.Engine(model_path=model_path, **{**ENGINE_ARGS, **engine_args})
        try:
            yield llm
        finally:
            llm.shutdown()
