"""The formats API: names, selection rule, output layout, errors, fused groups, dequantize_view."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

import flipsync.formats
from flipsync.errors import ConfigError, FormatError, NonFiniteError
from flipsync.formats import (
    FORMAT_NAMES,
    ServedFormat,
    dequantize_view,
    fused_groups_auto,
    get_format,
    served_view,
)

QUANTIZED = [f for f in FORMAT_NAMES if f not in ("bf16", "fp16")]

# (payload dtype, {suffix: (dtype, shape)}) for a master of shape [70, 100]
LAYOUT = {
    "fp8-tensor": (torch.float8_e4m3fn, (70, 100), {"_scale": (torch.float32, (1,))}),
    "fp8-channel": (torch.float8_e4m3fn, (70, 100), {"_scale": (torch.float32, (70, 1))}),
    "int8-channel": (torch.int8, (70, 100), {"_scale": (torch.float32, (70, 1))}),
    "fp8-block": (torch.float8_e4m3fn, (70, 100), {"_scale_inv": (torch.float32, (1, 1))}),
    "mxfp8": (torch.float8_e4m3fn, (70, 100), {"_scale": (torch.uint8, (70, 4))}),
    "mxfp4": (torch.uint8, (70, 50), {"_scale": (torch.uint8, (70, 4))}),
    "nvfp4": (
        torch.uint8,
        (70, 50),
        {"_scale": (torch.float8_e4m3fn, (70, 7)), "_scale_2": (torch.float32, (1,))},
    ),
}


def test_format_names_and_lookup() -> None:
    assert FORMAT_NAMES == (
        "bf16",
        "fp16",
        "fp8-tensor",
        "fp8-channel",
        "fp8-block",
        "mxfp8",
        "mxfp4",
        "nvfp4",
        "int8-channel",
    )
    for name in FORMAT_NAMES:
        fmt = get_format(name)
        assert isinstance(fmt, ServedFormat) and fmt.name == name
        assert get_format(fmt) is fmt


def test_unknown_format_lists_valid_names() -> None:
    with pytest.raises(ConfigError) as info:
        get_format("int4")
    for name in FORMAT_NAMES:
        assert name in str(info.value)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_output_names_dtypes_shapes(fmt: str) -> None:
    payload_dtype, payload_shape, scales = LAYOUT[fmt]
    out = served_view({"m.o_proj.weight": torch.randn(70, 100)}, fmt)
    assert list(out) == ["m.o_proj.weight", *("m.o_proj.weight" + s for s in scales)]
    assert out["m.o_proj.weight"].dtype == payload_dtype
    assert tuple(out["m.o_proj.weight"].shape) == payload_shape
    for suffix, (dtype, shape) in scales.items():
        assert out["m.o_proj.weight" + suffix].dtype == dtype
        assert tuple(out["m.o_proj.weight" + suffix].shape) == shape
    for tensor in out.values():
        assert tensor.is_contiguous()


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(16, generator=g),
        "model.layers.0.self_attn.q_norm.weight": torch.randn(4, 4, generator=g),  # 2-D, but 'norm'
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=g),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16, 16, generator=g),  # not *weight
        "model.layers.0.mlp.experts.w13_weight": torch.randn(2, 8, 16, generator=g),  # 3-D
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 32, generator=g),
        "model.layers.0.mlp.empty.weight": torch.zeros(0, 16),
        "lm_head.weight": torch.randn(32, 16, generator=g),
        "model.rotary.inv_freq_steps": torch.arange(8),
    }


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_selection_rule(fmt: str) -> None:
    model = _model()
    out = served_view(model, fmt)
    quantized = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"}
    high = torch.float16 if fmt == "fp16" else torch.bfloat16
    for name, tensor in model.items():
        if name == "model.rotary.inv_freq_steps":
            assert out[name] is tensor  # non-float: passed through unchanged
        elif fmt in QUANTIZED and name in quantized:
            assert out[name].dtype == get_format(fmt).payload_dtype
            assert name + get_format(fmt).scale_suffixes[0] in out
        else:
            assert out[name].dtype == high
            assert torch.equal(out[name], tensor.to(high))
    extra = set(out) - set(model)
    assert len(extra) == (len(quantized) * len(get_format(fmt).scale_suffixes) if fmt in QUANTIZED else 0)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_keep_overrides_quantization(fmt: str) -> None:
    model = _model()
    out = served_view(model, fmt, keep=lambda name, t: "down_proj" in name)
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.mlp.down_proj.weight_scale" not in out
    assert out["model.layers.0.self_attn.q_proj.weight"].dtype == get_format(fmt).payload_dtype


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_master_refused_with_name(fmt: str, bad: float) -> None:
    x = torch.randn(8, 32)
    x[3, 5] = bad
    with pytest.raises(NonFiniteError, match=r"layers\.3\.mlp\.up_proj\.weight"):
        served_view({"layers.3.mlp.up_proj.weight": x}, fmt)
    with pytest.raises(NonFiniteError, match="norm"):  # unquantized tensors are checked as well
        served_view({"norm.weight": x}, fmt)
    assert issubclass(NonFiniteError, FormatError)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_float64_master_refused(fmt: str) -> None:
    with pytest.raises(FormatError, match=r"w\.weight.*float64"):
        served_view({"w.weight": torch.randn(4, 32, dtype=torch.float64)}, fmt)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_masters_are_upcast(fmt: str, dtype: torch.dtype) -> None:
    x = torch.randn(6, 32).to(dtype)
    a = served_view({"w.weight": x}, fmt)
    b = served_view({"w.weight": x.float()}, fmt)
    for key in b:
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_odd_last_dim_refused_for_fp4(fmt: str) -> None:
    with pytest.raises(FormatError, match=r"'w\.weight'.*\[4, 33\].*odd"):
        served_view({"w.weight": torch.randn(4, 33)}, fmt)
    served_view({"w.weight": torch.randn(4, 33)}, fmt, keep=lambda n, t: True)  # keep: fine


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantize_rejects_non_2d(fmt: str) -> None:
    with pytest.raises(FormatError, match=r"w\.weight.*\[2, 4, 32\]"):
        get_format(fmt).quantize("w.weight", torch.randn(2, 4, 32))


def test_quantize_rejects_group_amax_below_own() -> None:
    with pytest.raises(FormatError, match="group_amax"):
        get_format("fp8-tensor").quantize("w.weight", torch.full((2, 2), 3.0), group_amax=1.0)


# --- fused groups ---------------------------------------------------------------------------------


def test_fused_groups_auto() -> None:
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",  # lone: no group
        "model.layers.2.mlp.experts.0.gate_proj.weight",
        "model.layers.2.mlp.experts.0.up_proj.weight",
        "model.layers.2.mlp.experts.1.gate_proj.weight",
        "model.layers.2.mlp.experts.1.up_proj.weight",
        "model.layers.2.mlp.shared_experts.gate_proj.weight",
        "model.layers.2.mlp.shared_experts.up_proj.weight",
        "model.layers.3.block_sparse_moe.experts.0.w1.weight",
        "model.layers.3.block_sparse_moe.experts.0.w2.weight",
        "model.layers.3.block_sparse_moe.experts.0.w3.weight",
        "model.layers.0.self_attn.q_proj.bias",
    ]
    assert fused_groups_auto(names) == [
        [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
        ],
        ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"],
        ["model.layers.2.mlp.experts.0.gate_proj.weight", "model.layers.2.mlp.experts.0.up_proj.weight"],
        ["model.layers.2.mlp.experts.1.gate_proj.weight", "model.layers.2.mlp.experts.1.up_proj.weight"],
        [
            "model.layers.2.mlp.shared_experts.gate_proj.weight",
            "model.layers.2.mlp.shared_experts.up_proj.weight",
        ],
        [
            "model.layers.3.block_sparse_moe.experts.0.w1.weight",
            "model.layers.3.block_sparse_moe.experts.0.w3.weight",
        ],
    ]
    assert fused_groups_auto(["q_proj.weight", "k_proj.weight"]) == [["q_proj.weight", "k_proj.weight"]]


def _qkv() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "l.q_proj.weight": torch.randn(16, 32, generator=g) * 0.5,
        "l.k_proj.weight": torch.randn(16, 32, generator=g) * 3.0,
        "l.v_proj.weight": torch.randn(16, 32, generator=g),
    }


def test_fp8_tensor_fused_group_shares_one_scale() -> None:
    masters = _qkv()
    out = served_view(masters, "fp8-tensor")
    amax = max(float(t.to(torch.bfloat16).float().abs().max()) for t in masters.values())
    scales = [out[n + "_scale"] for n in masters]
    assert all(torch.equal(s.view(torch.int32), scales[0].view(torch.int32)) for s in scales)
    assert torch.equal(scales[0], torch.tensor([amax]) / 448.0)
    for name, tensor in masters.items():
        alone = get_format("fp8-tensor").quantize(name, tensor, group_amax=amax)
        assert torch.equal(out[name].view(torch.uint8), alone[name].view(torch.uint8))
    separate = served_view(masters, "fp8-tensor", fused_groups=None)
    assert len({int(separate[n + "_scale"].view(torch.int32)) for n in masters}) == 3


def test_nvfp4_fused_group_shares_global_scale() -> None:
    masters = _qkv()
    out = served_view(masters, "nvfp4")
    s2 = {int(out[n + "_scale_2"].view(torch.int32)) for n in masters}
    assert len(s2) == 1
    separate = served_view(masters, "nvfp4", fused_groups=None)
    assert len({int(separate[n + "_scale_2"].view(torch.int32)) for n in masters}) == 3


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8-channel", "fp8-block", "mxfp8", "mxfp4"])
def test_other_formats_ignore_groups(fmt: str) -> None:
    masters = _qkv()
    grouped, separate = served_view(masters, fmt), served_view(masters, fmt, fused_groups=None)
    assert grouped.keys() == separate.keys()
    for key in grouped:
        assert torch.equal(grouped[key].view(torch.uint8), separate[key].view(torch.uint8))


def test_explicit_groups_and_kept_members() -> None:
    masters = _qkv()
    out = served_view(masters, "fp8-tensor", fused_groups=[["l.q_proj.weight", "l.v_proj.weight"]])
    assert torch.equal(out["l.q_proj.weight_scale"], out["l.v_proj.weight_scale"])
    assert not torch.equal(out["l.q_proj.weight_scale"], out["l.k_proj.weight_scale"])
    kept = served_view(masters, "fp8-tensor", keep=lambda n, t: n.startswith("l.k_proj"))
    assert kept["l.k_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(kept["l.q_proj.weight_scale"], kept["l.v_proj.weight_scale"])
    assert not torch.equal(kept["l.q_proj.weight_scale"], out["l.k_proj.weight_scale"])


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([["l.q_proj.weight", "nope.weight"]], "nope.weight"),
        (["l.q_proj.weight"], "bare name"),
        ([["l.q_proj.weight", "l.k_proj.weight"], ["l.k_proj.weight", "l.v_proj.weight"]], "more than one"),
        ("fused", "fused_groups"),
    ],
)
def test_bad_fused_groups(groups: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        served_view(_qkv(), "fp8-tensor", fused_groups=groups)  # type: ignore[arg-type]


def test_name_collision_refused() -> None:
    masters = {"a.weight": torch.randn(4, 32), "a.weight_scale": torch.randn(4, 32)}
    with pytest.raises(ConfigError, match="collides"):
        served_view(masters, "fp8-tensor", keep=lambda n, t: n == "a.weight_scale")


# --- dequantize_view -------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_dequantize_view_keys_and_dtypes(fmt: str) -> None:
    model = _model()
    deq = dequantize_view(served_view(model, fmt), fmt)
    assert list(deq) == list(model)
    for name, tensor in deq.items():
        if model[name].is_floating_point():
            assert tensor.dtype == torch.float32 and tensor.shape == model[name].shape
        else:
            assert tensor is model[name]


def test_no_flush_denormal_in_recipes() -> None:
    src = pathlib.Path(flipsync.formats.__file__).parent
    for path in src.glob("*.py"):
        assert "set_flush_denormal" not in path.read_text(), path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_cuda_gives_the_cpu_bytes(fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    masters = {
        "a.q_proj.weight": torch.randn(300, 260, generator=g),
        "a.k_proj.weight": torch.zeros(300, 260),
    }
    masters["a.k_proj.weight"][7, :64] = torch.randn(64, generator=g) * 1e-3
    cpu = served_view(masters, fmt)
    gpu = served_view({k: v.cuda() for k, v in masters.items()}, fmt)
    for key, tensor in cpu.items():
        assert gpu[key].device.type == "cuda"
        assert torch.equal(gpu[key].cpu().view(torch.uint8), tensor.view(torch.uint8)), key


# --- tensors kept in the checkpoint's own dtype ---------------------------------------------------------


@pytest.mark.parametrize("fmt", ["bf16", "int8-channel", "fp8-channel"])
def test_dtypes_serve_named_tensors_as_the_checkpoint_holds_them(fmt: str) -> None:
    """FP32 norms and router weights beside BF16 (or quantized) weights, as released checkpoints ship them:
    served with the master's own bits, never aliasing the master, and never quantized."""
    g = torch.Generator().manual_seed(0)
    masters = {
        "l.input_layernorm.weight": torch.randn(8, generator=g),
        "l.mlp.gate.weight": torch.randn(4, 8, generator=g),  # a router: 2-D, quantizable by name
        "l.mlp.down_proj.weight": torch.randn(8, 16, generator=g),
    }
    masters["l.input_layernorm.weight"][0] = 2.0**-140  # an fp32 subnormal: kept as it is
    dtypes = {"l.input_layernorm.weight": torch.float32, "l.mlp.gate.weight": torch.float32}
    out = served_view(masters, fmt, dtypes=dtypes)
    for name in dtypes:
        assert out[name].dtype == torch.float32 and name + "_scale" not in out
        assert torch.equal(out[name].view(torch.int32), masters[name].view(torch.int32))
        assert out[name].data_ptr() != masters[name].data_ptr()
    assert out["l.mlp.down_proj.weight"].dtype == get_format(fmt).payload_dtype
    assert dequantize_view(out, fmt)["l.mlp.gate.weight"].equal(masters["l.mlp.gate.weight"])
    bad = dict(masters)
    bad["l.input_layernorm.weight"] = masters["l.input_layernorm.weight"].clone()
    bad["l.input_layernorm.weight"][1] = float("nan")
    with pytest.raises(NonFiniteError, match="input_layernorm"):
        served_view(bad, fmt, dtypes=dtypes)
    with pytest.raises(ConfigError, match="not a master"):
        served_view(masters, fmt, dtypes={"nope": torch.float32})
    with pytest.raises(ConfigError, match="float8"):
        served_view(masters, fmt, dtypes={"l.mlp.gate.weight": torch.float8_e4m3fn})


def test_checkpoint_dtypes_follow_the_checkpoint_headers() -> None:
    from flipsync.formats import checkpoint_dtypes

    masters = {"n.weight": torch.randn(4), "a.proj.weight": torch.randn(4, 4), "b.proj.weight": torch.randn(4, 4)}
    headers = {"n.weight": "F32", "a.proj.weight": "I8", "b.proj.weight": "BF16"}  # b: left unquantized
    assert checkpoint_dtypes(headers, "int8-channel", masters) == {
        "n.weight": torch.float32,
        "b.proj.weight": torch.bfloat16,
    }
    assert checkpoint_dtypes({"n.weight": "F32", "b.proj.weight": "BF16"}, "bf16", masters) == {
        "n.weight": torch.float32
    }


def test_the_fused_pass_diffs_fp32_tensors_by_32_bit_patterns() -> None:
    from flipsync.formats.cast_diff import CastDiffer

    x = torch.randn(1000)
    prev = x.clone()
    prev.view(torch.int32)[::97] += 1
    with CastDiffer(1) as caster:
        new, changes = caster.cast_diff("n.weight", x, torch.float32, prev)
    assert torch.equal(new.view(torch.int32), x.view(torch.int32)) and new.data_ptr() != x.data_ptr()
    assert changes.positions.tolist() == list(range(0, 1000, 97))
    assert changes.old.dtype == np.uint32 and np.array_equal(
        changes.new, x.view(torch.int32).numpy()[::97].view(np.uint32)
    )
