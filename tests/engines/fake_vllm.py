"""A small model that mimics how vLLM loads a Llama checkpoint, for tests that run without vLLM.

Like vLLM's ``LlamaForCausalLM``: ``q/k/v_proj`` load into one fused ``qkv_proj`` and ``gate/up_proj`` into
``gate_up_proj`` through ``stacked_params_mapping`` and per-shard weight loaders; column-parallel layers keep
their rank's rows, row-parallel layers (``o_proj``, ``down_proj``) their rank's columns; the vocabulary is
padded and split by rows (``VocabParallelEmbedding``); norms are replicated and use the default loader.
``load_weights`` returns the names of the parameters it loaded.

A layer built with ``packed=True`` computes from a copy made by ``process_weights_after_loading`` and then
drops its weight, like vLLM's CPU backend does for oneDNN: patches must go through the reload path; with
``packed="none"`` it sets the weight to None instead (vLLM's oneDNN INT8 path). ``moe=True`` replaces each
layer's MLP by fused experts (``experts.<e>.gate_proj/up_proj`` into ``w13``, ``down_proj`` into ``w2``) whose
method object prepacks them in place on the first load only, as vLLM CPU's ``UnquantizedFusedMoEMethod`` does
(its weight-update path skips the prepack). ``norm_dtype`` keeps the norms in another dtype than the
checkpoint's (FP32 norms fed from BF16 tensors: an exact widening).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from flipsync.codec.bits import int_view
from flipsync.engines.vllm.blockmap import expand_blocks
from flipsync.engines.vllm.kernels import KernelHooks, default_kind, default_transplant, default_twin, probe_rows
from flipsync.engines.vllm.worker import WorkerCore

_EXPERT = re.compile(r"^(.*\.mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, (param.shape, loaded.shape)
    param.data.copy_(loaded)


class ColumnLinear(nn.Module):
    """Output rows split across ranks; ``shards`` names the fused pieces (q, k, v) and their full sizes."""

    def __init__(self, in_f: int, shards: dict[str | int, int], rank: int, size: int, packed: bool | str) -> None:
        super().__init__()
        self.shards = shards
        self.rank, self.size, self.packed = rank, size, packed
        rows = sum(n // size for n in shards.values())
        self.weight = nn.Parameter(torch.zeros(rows, in_f, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.packed_copy: torch.Tensor | None = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id is None:
            assert len(self.shards) == 1
            shard_id = next(iter(self.shards))
        offset = 0
        for sid, n in self.shards.items():
            per = n // self.size
            if sid == shard_id:
                param.data.narrow(0, offset, per).copy_(loaded.narrow(0, self.rank * per, per))
                return
            offset += per
        raise KeyError(shard_id)

    def process_weights_after_loading(self) -> None:
        if self.packed:
            self.packed_copy = self.weight.detach().clone().t().contiguous()  # a "repacked" layout
            if self.packed == "none":
                self.weight = None  # type: ignore[assignment]  # the kernel keeps the only copy, as oneDNN INT8
            else:
                self.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)

    def effective(self) -> torch.Tensor:
        scale = self._parameters.get("input_scale")
        if self.packed:
            assert self.packed_copy is not None
            out = self.packed_copy.t()
        else:
            out = self.weight
        return out if scale is None else (out.float() * scale).to(out.dtype)


class RowLinear(nn.Module):
    """Input columns split across ranks."""

    def __init__(self, in_f: int, out_f: int, rank: int, size: int, packed: bool | str) -> None:
        super().__init__()
        self.rank, self.size, self.packed = rank, size, packed
        self.weight = nn.Parameter(torch.zeros(out_f, in_f // size, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.packed_copy: torch.Tensor | None = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        per = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.rank * per, per))

    process_weights_after_loading = ColumnLinear.process_weights_after_loading
    effective = ColumnLinear.effective


class VocabEmbedding(nn.Module):
    """Vocabulary padded to a multiple of 8 and split by rows; padding rows are zero-filled."""

    def __init__(self, vocab: int, dim: int, rank: int, size: int) -> None:
        super().__init__()
        padded = -(-vocab // (8 * size)) * 8 * size
        self.per = padded // size
        self.rank = rank
        self.weight = nn.Parameter(torch.zeros(self.per, dim, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        start = self.rank * self.per
        n = max(0, min(self.per, loaded.shape[0] - start))
        param.data[:n].copy_(loaded[start : start + n])
        param.data[n:].fill_(0)


class Norm(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)


class FakeMoeMethod:
    """The experts' method object: prepacks on the first call only (its kernel is built then), as vLLM CPU's
    ``UnquantizedFusedMoEMethod`` does; ``faithful=True`` prepacks on every call. ``keep=True``: the packed copies
    the kernel reads are plain attributes of the method (``packed_w13``, ``packed_w2``), the layer's tensors stay
    as loaded; with a router, the method also keeps the router bias it derived (``bias_packed``)."""

    def __init__(self, faithful: bool = False, keep: bool = False) -> None:
        self.faithful = faithful
        self.keep = keep
        self.kernel: object | None = None

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.kernel is None or self.faithful:
            with torch.no_grad():  # "prepack": a same-shape relayout the kernel reads (last dim reversed)
                if self.keep:
                    self.packed_w13 = layer.w13.detach().flip(-1).clone()
                    self.packed_w2 = layer.w2.detach().flip(-1).clone()
                else:
                    layer.w13.data.copy_(layer.w13.data.flip(-1))
                    layer.w2.data.copy_(layer.w2.data.flip(-1))
                bias = layer._parameters.get("e_score_correction_bias")
                if bias is not None:
                    self.bias_packed = bias.detach().float().clone()
        self.kernel = object()


class FakeMoeModuleMethod(nn.Module):
    """The same method as a child module (vLLM's MoE quant methods are ``nn.Module`` s), packed copies kept."""

    def __init__(self, faithful: bool = False) -> None:
        super().__init__()
        self.faithful = faithful
        self.keep = True
        self.kernel: object | None = None

    process_weights_after_loading = FakeMoeMethod.process_weights_after_loading


class Router(nn.Module):
    """GLM's router (``mlp.gate``): a packed linear and an FP32-kept score-correction bias that the fused experts
    hold too (one tensor, two holders)."""

    packed = True

    def __init__(self, n: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, hidden, dtype=torch.bfloat16), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.packed_copy: torch.Tensor | None = None

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.packed_copy = self.weight.detach().clone().t().contiguous()
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)

    def effective(self) -> torch.Tensor:
        assert self.packed_copy is not None
        return self.packed_copy.t()


class Experts(nn.Module):
    """Fused experts: ``experts.<e>.gate_proj``/``up_proj`` rows into ``w13`` [E, 2I/size, H] (column shard),
    ``down_proj`` into ``w2`` [E, H, I/size] (row-parallel: column shard)."""

    packed = True

    def __init__(self, n: int, hidden: int, inter: int, rank: int, size: int, faithful: bool, method: str = "") -> None:
        super().__init__()
        self.n, self.inter, self.rank, self.size = n, inter, rank, size
        per = inter // size
        self.w13 = nn.Parameter(torch.zeros(n, 2 * per, hidden, dtype=torch.bfloat16), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(n, hidden, per, dtype=torch.bfloat16), requires_grad=False)
        self.w13.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w2.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # method "": prepacks the layer's own tensors; "plain": keeps packed copies in the method object;
        # "module": the same, the method being a child module
        self.quant_method = (
            FakeMoeModuleMethod(faithful) if method == "module" else FakeMoeMethod(faithful, bool(method))
        )

    def kernel_weight(self, attr: str) -> torch.Tensor:
        """What the kernel reads for ``w13`` / ``w2``, unpacked."""
        method = self.quant_method
        packed = getattr(method, f"packed_{attr}", None) if method.keep else getattr(self, attr)
        assert packed is not None
        return packed.flip(-1)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, expert: int, shard: str) -> None:
        per = self.inter // self.size
        if shard == "w2":
            param.data[expert].copy_(loaded.narrow(1, self.rank * per, per))
        else:
            offset = 0 if shard == "w1" else per
            param.data[expert, offset : offset + per].copy_(loaded.narrow(0, self.rank * per, per))


class Layer(nn.Module):
    def __init__(
        self,
        hidden: int,
        q: int,
        kv: int,
        inter: int,
        rank: int,
        size: int,
        packed: bool | str,
        norm_dtype: torch.dtype = torch.bfloat16,
        moe: int = 0,
        faithful_moe: bool = False,
        moe_method: str = "",
        router: bool = False,
        scale: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = ColumnLinear(hidden, {"q": q, "k": kv, "v": kv}, rank, size, packed)
        self.self_attn.o_proj = RowLinear(q, hidden, rank, size, packed)
        if scale:  # a parameter no checkpoint holds, which a fresh load sets to one
            self.self_attn.o_proj.input_scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)
        self.mlp = nn.Module()
        if moe:
            if router:
                self.mlp.gate = Router(moe, hidden)
            self.mlp.experts = Experts(moe, hidden, inter, rank, size, faithful_moe, moe_method)
            if router:  # one tensor, two holders (vLLM's FusedMoE registers the gate's bias as its own)
                self.mlp.experts.e_score_correction_bias = self.mlp.gate.e_score_correction_bias
        else:
            self.mlp.gate_up_proj = ColumnLinear(hidden, {0: inter, 1: inter}, rank, size, packed)
            self.mlp.down_proj = RowLinear(inter, hidden, rank, size, packed)
        self.input_layernorm = Norm(hidden, norm_dtype)
        self.post_attention_layernorm = Norm(hidden, norm_dtype)


class FakeLlama(nn.Module):
    stacked_params_mapping: ClassVar[list[tuple[str, str, str | int]]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(
        self,
        *,
        vocab: int = 50,
        hidden: int = 16,
        q: int = 16,
        kv: int = 8,
        inter: int = 24,
        layers: int = 2,
        rank: int = 0,
        size: int = 1,
        packed: bool | str = False,
        norm_dtype: torch.dtype = torch.bfloat16,
        moe: int = 0,
        faithful_moe: bool = False,
        moe_method: str = "",
        router: bool = False,
        scale: bool = False,
    ) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabEmbedding(vocab, hidden, rank, size)
        self.model.layers = nn.ModuleList(
            Layer(hidden, q, kv, inter, rank, size, packed, norm_dtype, moe, faithful_moe, moe_method, router, scale)
            for _ in range(layers)
        )
        self.model.norm = Norm(hidden, norm_dtype)
        self.lm_head = ColumnLinear(hidden, {0: -(-vocab // (8 * size)) * 8 * size}, rank, size, packed)
        self.lm_head.weight.weight_loader = self._lm_head_loader  # type: ignore[attr-defined]
        self.lm_head._loader_for_scratch = self._lm_head_loader
        self.vocab = vocab

    def _lm_head_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        per = param.shape[0]
        start = self.lm_head.rank * per
        n = max(0, min(per, loaded.shape[0] - start))
        param.data[:n].copy_(loaded[start : start + n])
        param.data[n:].fill_(0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            expert = _EXPERT.match(name)
            if expert is not None:  # experts.<e>.<proj>.weight -> the layer's fused w13 / w2
                prefix, e, proj = expert.groups()
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
                target = f"{prefix}experts.{'w2' if shard == 'w2' else 'w13'}"
                param = params[target]
                param.weight_loader(param, w, int(e), shard)  # type: ignore[attr-defined]
                loaded.add(target)
                continue
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name not in name:
                    continue
                target = name.replace(weight_name, param_name)
                param = params[target]
                param.weight_loader(param, w, shard_id)  # type: ignore[attr-defined]
                loaded.add(target)
                break
            else:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, w)
                loaded.add(name)
        return loaded

    def process_weights_after_loading(self, modules: Iterable[str] | None = None) -> None:
        wanted = set(modules) if modules is not None else None
        for mname, mod in self.named_modules():
            if mod is self or (wanted is not None and mname not in wanted) or mname.endswith(".quant_method"):
                continue
            if hasattr(mod, "quant_method"):
                mod.quant_method.process_weights_after_loading(mod)
            elif hasattr(mod, "process_weights_after_loading"):
                mod.process_weights_after_loading()

    def effective(self, name: str) -> torch.Tensor:
        """What the 'kernel' computes from for a vLLM parameter name (repacked copies for packed layers, the
        experts unpacked from their prepacked layout)."""
        mname, _, pname = name.rpartition(".")
        mod = self.get_submodule(mname)
        if isinstance(mod, Experts):
            return mod.kernel_weight(pname)
        if isinstance(mod, Router) and pname != "weight":
            return getattr(mod, pname)
        return mod.effective() if hasattr(mod, "effective") else getattr(mod, pname)


def fake_policy(module_name: str, module: nn.Module, pname: str, param: torch.Tensor) -> tuple[bool, str]:
    if getattr(module, "packed", False):
        return False, "packed copy"
    return True, "as loaded"


def _dropped(mod: nn.Module) -> bool:
    return getattr(mod, "packed", False) and (mod.weight is None or mod.weight.numel() == 0)


Fault = Callable[[FakeLlama, set[str]], None]


def make_reloader(model: FakeLlama, *, stale: bool = False, fault: list[Fault] | None = None):
    """The fake's layerwise reload: restore model-format params of every repacked layer, load, process the
    touched ones and copy their results into the kernel tensors (experts), put the untouched ones back.
    ``stale``: packed layers keep their old packed copy (an engine whose opaque handle is not rebuilt);
    ``fault``: callables run on (model, touched layers) after processing (a broken update path)."""

    def reload(tensors: list[tuple[str, torch.Tensor]]) -> None:
        experts: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        for mname, mod in model.named_modules():
            if isinstance(mod, Experts):  # fresh model-format tensors, kernel tensors kept aside
                experts[mname] = (mod.w13, mod.w2)
                for attr in ("w13", "w2"):
                    old = getattr(mod, attr)
                    new = nn.Parameter(torch.zeros_like(old), requires_grad=False)
                    new.weight_loader = mod.weight_loader  # type: ignore[attr-defined]
                    setattr(mod, attr, new)
            elif _dropped(mod):
                # restore the model-format parameter (vLLM does this from recorded metadata)
                shape = tuple(mod.packed_copy.t().shape)
                mod._was = mod.weight  # type: ignore[assignment]
                mod.weight = nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16), requires_grad=False)
                mod.weight.weight_loader = (  # type: ignore[attr-defined]
                    model._lm_head_loader if mname == "lm_head" else mod.weight_loader
                )
                mod._restored = True  # type: ignore[assignment]
        loaded = model.load_weights(tensors)
        touched = {n.rpartition(".")[0] for n in loaded}
        for mname, mod in model.named_modules():
            if mname in experts:
                w13, w2 = experts[mname]
                if mname in touched:
                    mod.quant_method.process_weights_after_loading(mod)
                    w13.data.copy_(mod.w13.data)
                    w2.data.copy_(mod.w2.data)
                mod.w13, mod.w2 = w13, w2
            elif getattr(mod, "_restored", False):
                mod._restored = False  # type: ignore[assignment]
                if mname in touched and not stale:
                    mod.process_weights_after_loading()
                else:  # untouched (or a stale engine): put the old packed state back
                    mod.weight = mod._was
                del mod._was  # (registered as a parameter by nn.Module)
        for f in fault or []:
            f(model, touched)

    return reload


def packed_scratch(module: nn.Module, pname: str, live: torch.Tensor | None) -> torch.Tensor | None:
    """Model-format scratch for dropped weights (vLLM rebuilds it from recorded metadata)."""
    from flipsync.engines.vllm.scratch import copy_attrs, default_scratch

    if (live is None or live.numel() == 0) and getattr(module, "packed_copy", None) is not None:
        shape = tuple(module.packed_copy.t().shape)
        t = torch.zeros(shape, dtype=module.packed_copy.dtype)
        tmpl = torch.nn.Parameter(torch.empty(0, dtype=module.packed_copy.dtype), requires_grad=False)
        owner_loader = getattr(module, "_loader_for_scratch", None) or module.weight_loader
        tmpl.weight_loader = owner_loader  # type: ignore[attr-defined]
        return copy_attrs(t, tmpl, module)
    if live is None:
        return None
    return default_scratch(module, pname, live)


def fake_probe(mname: str, module: nn.Module, rows: int | None, seed: int) -> dict[str, torch.Tensor]:
    """What a packed layer's 'kernel' computes from (its packed copy, read back), for the rows probed; the fused
    experts' kernel on fixed inputs with each expert forced in turn."""
    if isinstance(module, Experts):
        return {"experts": experts_probe(module, 4)} if MOE_PROBE else {}
    if not getattr(module, "packed", False) or module.packed_copy is None:
        return {}
    eff = module.effective()
    return {"effective": eff[:, torch.from_numpy(probe_rows(eff.shape[1], rows, seed))]}


MOE_PROBE = True  # the fused experts probed through their kernel (blind spot 1); a test may switch it off


def experts_probe(module: Experts, tokens: int) -> torch.Tensor:
    """Every expert's output on the same fixed tokens: silu(x W1) * (x W3) W2 from the weights the kernel reads."""
    w13, w2 = module.kernel_weight("w13").float(), module.kernel_weight("w2").float()
    per = w13.shape[1] // 2
    x = torch.randn((tokens, w13.shape[2]), generator=torch.Generator().manual_seed(0))
    outs = []
    for e in range(w13.shape[0]):
        h = torch.nn.functional.silu(x @ w13[e, :per].T) * (x @ w13[e, per:].T)
        outs.append(h @ w2[e].T)
    return torch.stack(outs)


FAKE_HOOKS = KernelHooks(default_twin, fake_probe, default_transplant, default_kind)


# ------------------------------------------------------------------------------------ test helpers
DIMS = {"vocab": 50, "hidden": 16, "q": 16, "kv": 8, "inter": 24, "layers": 2}


def checkpoint(seed: int = 0, *, moe: int = 0, router: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, q, kv, inter, vocab = DIMS["hidden"], DIMS["q"], DIMS["kv"], DIMS["inter"], DIMS["vocab"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(DIMS["layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        experts = [f"{p}mlp.experts.{e}." for e in range(moe)] if moe else [p + "mlp."]
        if router:
            shapes |= {p + "mlp.gate.weight": (moe, h), p + "mlp.gate.e_score_correction_bias": (moe,)}
        for e in experts:
            shapes |= {
                e + "gate_proj.weight": (inter, h),
                e + "up_proj.weight": (inter, h),
                e + "down_proj.weight": (h, inter),
            }
    return {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in sorted(shapes.items())}


def boot(
    view: dict[str, torch.Tensor],
    *,
    size: int = 1,
    packed: bool | str = False,
    norm_dtype: torch.dtype = torch.bfloat16,
    moe: int = 0,
    faithful_moe: bool = False,
    moe_method: str = "",
    router: bool = False,
    scale: bool = False,
    stale: bool = False,
    fault: list[Fault] | None = None,
    hooks: KernelHooks | None = None,
) -> list[tuple[FakeLlama, WorkerCore]]:
    """Fake workers that loaded ``view`` at start-up, as vLLM does (load, then process)."""
    out = []
    for rank in range(size):
        model = FakeLlama(
            **DIMS,
            rank=rank,
            size=size,
            packed=packed,
            norm_dtype=norm_dtype,
            moe=moe,
            faithful_moe=faithful_moe,
            moe_method=moe_method,
            router=router,
            scale=scale,
        )
        model.load_weights(view.items())
        model.process_weights_after_loading()
        core = WorkerCore(
            model,
            rank=rank,
            policy=fake_policy,
            scratch=packed_scratch,
            reloader=make_reloader(model, stale=stale, fault=fault),
            default_source=lambda v=view: v,
            hooks=hooks or FAKE_HOOKS,
        )
        out.append((model, core))
    return out


def held_view(pairs, engine) -> dict[str, torch.Tensor]:
    """Reassemble checkpoint tensors from what the fake kernels compute from, through the learned maps."""
    out = {}
    for name, spec in engine._specs.items():
        flat = torch.zeros(spec.numel, dtype=torch.bfloat16)
        seen = np.zeros(spec.numel, dtype=bool)
        for (model, _core), rank in zip(pairs, sorted(engine._maps, key=int), strict=True):
            for pname, blocks in engine._maps[rank].get(name, []):
                c, p = expand_blocks(blocks)
                src = int_view(model.effective(pname).to(torch.bfloat16).contiguous()).numpy()
                int_view(flat).numpy()[c] = src[p]
                seen[c] = True
        assert seen.all(), name
        out[name] = flat.reshape(spec.shape)
    return out


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(int_view(a[n]), int_view(b[n].contiguous())) for n in a)


def step(view: dict[str, torch.Tensor], seed: int, frac: float = 0.05) -> dict[str, torch.Tensor]:
    """A training step's worth of change: a few elements of every tensor move by one bf16 ulp."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for n, t in view.items():
        bits = int_view(t.clone()).clone()
        mask = torch.rand(bits.shape, generator=g) < frac
        bits[mask] += 1
        new[n] = bits.view(torch.bfloat16).reshape(t.shape)
    return new
