"""The GPU check's CUDA-graph case (``scripts/gpu-check``): a forward captured in a CUDA graph, a patch applied in
place through the codec and the torch engine, the graph replayed; its output must equal, bit for bit, an eager
forward of the patched model and one of a model freshly loaded from the target, and every parameter must keep
its storage address (what the captured graph reads). On a machine without CUDA the same steps run eagerly (the
codec path is exercised; nothing about graphs is shown) and the report says the graph part was skipped.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from flipsync.codec.bits import int_view


class GraphNet(torch.nn.Module):
    """A residual MLP stack with Llama-like names: enough for a captured forward over many weight tensors."""

    def __init__(self, hidden: int, inter: int, layers: int) -> None:
        super().__init__()
        self.config = SimpleNamespace(max_position_embeddings=2048, vocab_size=1)  # what the torch engine reads
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(layers):
            layer = torch.nn.Module()
            layer.input_layernorm = torch.nn.Module()
            layer.input_layernorm.weight = torch.nn.Parameter(torch.ones(hidden))
            layer.mlp = torch.nn.Module()
            layer.mlp.up_proj = torch.nn.Linear(hidden, inter, bias=False)
            layer.mlp.down_proj = torch.nn.Linear(inter, hidden, bias=False)
            self.model.layers.append(layer)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = h * layer.input_layernorm.weight
            h = h + layer.mlp.down_proj(torch.nn.functional.silu(layer.mlp.up_proj(x)))
        return h


def _net(device: torch.device, quick: bool, seed: int = 0) -> GraphNet:
    hidden, inter, layers = (64, 128, 2) if quick else (1024, 4096, 8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = GraphNet(hidden, inter, layers)
    return net.to(torch.bfloat16).to(device).eval().requires_grad_(False)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(int_view(a.detach().cpu().contiguous()), int_view(b.detach().cpu().contiguous())))


def cuda_graph_case(device: torch.device, quick: bool, fraction: float = 1e-2) -> dict[str, Any]:
    """Capture, patch in place, replay; compare with eager and with a fresh load (see the module's docstring)."""
    from flipsync.codec import diff_views
    from flipsync.codec.fingerprint import FingerprintTable
    from flipsync.engines.torch.engine import TorchEngine

    capture = device.type == "cuda"
    net = _net(device, quick)
    engine = TorchEngine(net, served_format="bf16")  # type: ignore[arg-type]
    base = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    new = {}
    for name, t in base.items():  # a training step: a fraction of the values move by one BF16 ulp
        bits = int_view(t.clone()).clone()
        bits[torch.rand(bits.shape, generator=g) < fraction] += 1
        new[name] = bits.view(torch.bfloat16).reshape(t.shape)
    patch, target = diff_views(base, new, old_table=FingerprintTable.of(base), context=False)
    x = torch.randn((8, base["model.layers.0.input_layernorm.weight"].numel()), generator=g).to(torch.bfloat16)
    x = x.to(device)
    with torch.no_grad():
        if capture:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                for _ in range(3):  # warm-up outside the graph, as torch requires
                    net(x)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y_static = net(x)

            def replay() -> torch.Tensor:
                graph.replay()
                torch.cuda.synchronize(device)
                return y_static.clone()
        else:

            def replay() -> torch.Tensor:
                return net(x).clone()

        eager0 = net(x).clone()
        before0 = replay()
        addresses = {n: p.data_ptr() for n, p in net.named_parameters()}
        undo = engine.commit(engine.stage(patch))
        reached = engine.table.view_fp() == target.view_fp()
        moved = sorted(n for n, p in net.named_parameters() if p.data_ptr() != addresses[n])
        after = replay()
        eager1 = net(x).clone()
        fresh = _net(device, quick)
        fresh.load_state_dict({k: v.to(device) for k, v in new.items()})
        fresh_y = fresh(x).clone()
        engine.rollback(undo)
        rolled = replay()
    out = {
        "captured": capture,
        "changed": sum(s.n for s in patch.sections),
        "target_reached": reached,
        "replay_before_equals_eager": _same(before0, eager0),
        "replay_after_patch_equals_eager": _same(after, eager1),
        "replay_after_patch_equals_fresh_load": _same(after, fresh_y),
        "output_changed": not _same(after, eager0),
        "replay_after_rollback_equals_before": _same(rolled, eager0),
        "parameters_moved": moved,
    }
    replays = all(v for k, v in out.items() if k.startswith("replay_"))
    out["ok"] = replays and reached and out["output_changed"] and not moved
    if not capture:
        out["skipped"] = "no CUDA device: the steps ran eagerly on the CPU; CUDA-graph replay was not checked"
    engine.close()
    return out
