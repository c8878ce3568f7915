"""A worker extension for the live vLLM tests that can break the engine's post-load step once, on one rank.

``FlipsyncFaultyExtension.flipsync_break_post_load(module, rank)`` makes the next post-load processing of that
layer (through vLLM's weight-update path) see its weight one ulp off at one element, on that rank only: a
deliberately broken step inside the engine's update path, which the kernel-state audit must catch. The twin
the audit builds gets a freshly constructed quant method, so it is not affected.
"""

from __future__ import annotations

import torch

from flipsync.engines.vllm.worker import FlipsyncWorkerExtension

EXTENSION = "vllm_faults.FlipsyncFaultyExtension"


class FlipsyncFaultyExtension(FlipsyncWorkerExtension):
    def flipsync_break_post_load(self, module: str, rank: int) -> bool:
        if int(getattr(self, "rank", 0)) != rank:
            return False
        layer = self.get_model().get_submodule(module)  # type: ignore[attr-defined]
        method = layer.quant_method
        original = type(method).process_weights_after_loading

        def broken(layer_arg: torch.nn.Module) -> None:
            del method.process_weights_after_loading  # once
            with torch.no_grad():  # a BF16 weight: one ulp up at element 0
                layer_arg.weight.view(-1)[:1].view(torch.int16).add_(1)
            original(method, layer_arg)

        method.process_weights_after_loading = broken
        return True
