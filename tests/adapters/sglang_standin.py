"""A stand-in for the parts of SGLang the adapter touches (SGLang itself needs a GPU).

It mirrors, by name and signature, SGLang's ``sglang.srt.eplb.expert_distribution``
(``ExpertDistributionRecorder.init_new(server_args, expert_location_metadata,
rank)``, the no-op and real recorders, ``get/set_global_expert_distribution_recorder``)
and ``sglang.srt.layers.moe.topk.select_experts``, which maps logical to
physical ids, masks the padded region with -1 and calls the global recorder's
``on_select_experts(topk_ids=...)``, as SGLang's does. :func:`model_forward`
plays the model runner: ``with_forward_pass`` around the layers,
``with_current_layer`` around each decoder layer.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class ServerArgs:
    model_path: str
    expert_distribution_recorder_mode: str | None = None
    device: str = "cpu"
    trust_remote_code: bool = False


@dataclass
class ExpertLocationMetadata:
    """``physical_to_logical_map [L, P]``: physical slot -> logical expert (redundant slots repeat one)."""

    physical_to_logical_map: torch.Tensor
    ep_size: int = 1

    @property
    def num_layers(self) -> int:
        return self.physical_to_logical_map.shape[0]

    @property
    def num_physical_experts(self) -> int:
        return self.physical_to_logical_map.shape[1]


@dataclass
class TopKConfig:
    top_k: int


def _build_modules() -> dict[str, types.ModuleType]:
    sglang = types.ModuleType("sglang")
    sglang.__version__ = "0.5.0"
    srt = types.ModuleType("sglang.srt")
    eplb = types.ModuleType("sglang.srt.eplb")
    dist = types.ModuleType("sglang.srt.eplb.expert_distribution")
    topk_mod = types.ModuleType("sglang.srt.layers.moe.topk")

    class ExpertDistributionRecorder:
        @staticmethod
        def init_new(server_args, expert_location_metadata, rank):
            if server_args.expert_distribution_recorder_mode is not None:
                return _ExpertDistributionRecorderReal(server_args, expert_location_metadata, rank)
            return _ExpertDistributionRecorderNoop()

        @contextlib.contextmanager
        def with_current_layer(self, layer_idx):
            yield

        @contextlib.contextmanager
        def with_debug_name(self, debug_name):
            yield

        @contextlib.contextmanager
        def disable_this_region(self):
            yield

        @contextlib.contextmanager
        def with_forward_pass(self, forward_pass_id, forward_batch):
            yield

        def on_select_experts(self, topk_ids):
            pass

        def on_deepep_dispatch_normal(self, local_physical_count_of_layer, num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert):
            pass

        def on_deepep_dispatch_low_latency(self, local_physical_count_of_layer):
            pass

        def start_record(self):
            raise Exception("Please set ServerArgs.expert_distribution_recorder_mode to use ExpertDistributionRecorder.")

        stop_record = start_record

        def dump_record(self, output_mode="file"):
            self.start_record()

        @property
        def recording(self):
            return False

    class _ExpertDistributionRecorderNoop(ExpertDistributionRecorder):
        pass

    class _ExpertDistributionRecorderReal(ExpertDistributionRecorder):
        """Counts ``[L, P]`` physical ids per layer, like SGLang's select-experts gatherer."""

        def __init__(self, server_args, expert_location_metadata, rank):
            self._server_args = server_args
            self._expert_location_metadata = expert_location_metadata
            self._rank = rank
            self._recording = False
            self._layer = None
            self.counts = torch.zeros(expert_location_metadata.num_layers, expert_location_metadata.num_physical_experts, dtype=torch.int64)
            self.dumps = []

        @contextlib.contextmanager
        def with_current_layer(self, layer_idx):
            previous, self._layer = self._layer, layer_idx
            try:
                yield
            finally:
                self._layer = previous

        def on_select_experts(self, topk_ids):
            if not self._recording:
                return
            ids = topk_ids.flatten()
            mask = ids != -1
            self.counts[self._layer].scatter_add_(0, ids.masked_fill(~mask, 0).long(), mask.long())

        def start_record(self):
            self.counts.zero_()
            self._recording = True

        def stop_record(self):
            self._recording = False

        def dump_record(self, output_mode="file"):
            self.dumps.append(output_mode)
            return {"logical_count": self.counts.clone()} if output_mode == "object" else None

        @property
        def recording(self):
            return self._recording

    state = {"recorder": _ExpertDistributionRecorderNoop()}

    def get_global_expert_distribution_recorder():
        return state["recorder"]

    def set_global_expert_distribution_recorder(value):
        state["recorder"] = value

    dist.ExpertDistributionRecorder = ExpertDistributionRecorder
    dist._ExpertDistributionRecorderNoop = _ExpertDistributionRecorderNoop
    dist._ExpertDistributionRecorderReal = _ExpertDistributionRecorderReal
    dist.get_global_expert_distribution_recorder = get_global_expert_distribution_recorder
    dist.set_global_expert_distribution_recorder = set_global_expert_distribution_recorder

    def select_experts(hidden_states, router_logits, topk_config, *, layer_id=None, num_token_non_padded=None, expert_location_dispatch_info=None):
        topk_weights, topk_ids = torch.topk(router_logits.softmax(-1), topk_config.top_k, dim=-1)
        if expert_location_dispatch_info is not None:  # logical -> physical (first replica of each expert)
            topk_ids = expert_location_dispatch_info[topk_ids]
        if num_token_non_padded is not None:  # SGLang's _mask_topk_ids_padded_region
            rows = torch.arange(topk_ids.shape[0]).unsqueeze(1)
            topk_ids = topk_ids.masked_fill(rows >= num_token_non_padded, -1)
        get_global_expert_distribution_recorder().on_select_experts(topk_ids=topk_ids)
        return topk_weights, topk_ids, router_logits

    topk_mod.select_experts = select_experts
    topk_mod.get_global_expert_distribution_recorder = get_global_expert_distribution_recorder
    return {
        "sglang": sglang,
        "sglang.srt": srt,
        "sglang.srt.eplb": eplb,
        "sglang.srt.eplb.expert_distribution": dist,
        "sglang.srt.layers.moe.topk": topk_mod,
    }


@contextlib.contextmanager
def standin_sglang() -> Iterator[types.SimpleNamespace]:
    """Install the stand-in modules in ``sys.modules`` for the duration of the block."""
    modules = _build_modules()
    saved = {name: sys.modules.get(name) for name in modules}
    sys.modules.update(modules)
    try:
        yield types.SimpleNamespace(dist=modules["sglang.srt.eplb.expert_distribution"], topk=modules["sglang.srt.layers.moe.topk"], sglang=modules["sglang"])
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def model_forward(sgl: types.SimpleNamespace, pass_id: int, logits: dict[int, torch.Tensor], top_k: int, num_layers: int,
                  dispatch: torch.Tensor | None = None, num_token_non_padded: int | None = None) -> dict[int, torch.Tensor]:
    """One model-runner forward: ``logits[layer] [T, E]`` for each MoE layer; returns the physical ids per layer."""
    recorder = sgl.dist.get_global_expert_distribution_recorder()
    chosen = {}
    with recorder.with_forward_pass(pass_id, object()):
        for layer in range(num_layers):
            with recorder.with_current_layer(layer):
                if layer in logits:
                    _, ids, _ = sgl.topk.select_experts(None, logits[layer], TopKConfig(top_k), layer_id=layer,
                                                        num_token_non_padded=num_token_non_padded, expert_location_dispatch_info=dispatch)
                    chosen[layer] = ids
    return chosen
