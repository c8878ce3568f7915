"""Hand-checked golden vectors for every served format (bytes compared as integers, never floats).

Each expected byte is derived in the comment next to it from the recipe in docs/formats.md.
e4m3 byte = s eeee mmm, value 2**(e-7) * (1 + m/8) (e = 0: 2**-6 * m/8); e2m1 codes: 0, .5, 1, 1.5,
2, 3, 4, 6 -> 0..7, sign adds 8; E8M0 byte b means 2**(b-127).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from flipsync.errors import FormatError
from flipsync.formats import dequantize_view, get_format, served_view


def u8(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def u16(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFF for v in t.contiguous().view(torch.int16).flatten().tolist()]


def u32(t: torch.Tensor) -> list[int]:
    return [v & 0xFFFFFFFF for v in t.contiguous().view(torch.int32).flatten().tolist()]


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def f32_from_bits(b: int) -> float:
    return struct.unpack("<f", struct.pack("<I", b))[0]


def serve(fmt: str, rows: list[list[float]] | torch.Tensor, name: str = "w.weight") -> dict[str, torch.Tensor]:
    x = rows if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.float32)
    return served_view({name: x}, fmt)


# --- bf16 / fp16 -----------------------------------------------------------------------------------

BF16_CASES = [
    (0.0, 0x0000),
    (-0.0, 0x8000),
    (1.0, 0x3F80),
    (-2.0, 0xC000),
    (1 + 2**-8, 0x3F80),  # tie between 0x3F80 (even) and 0x3F81 -> even
    (1 + 3 * 2**-8, 0x3F82),  # tie between 0x3F81 and 0x3F82 (even)
    (1 + 2**-8 + 2**-20, 0x3F81),  # just above the tie
    (2.0**-149, 0x0000),  # fp32 min subnormal: below half of bf16's min subnormal
    (2.0**-133, 0x0001),  # bf16 min subnormal
    (3 * 2.0**-134, 0x0002),  # 1.5 * 2**-133: tie -> even
    (f32_from_bits(0x7F7F0000), 0x7F7F),  # bf16 max finite
    (f32_from_bits(0x7F7F7FFF), 0x7F7F),  # largest fp32 that does not round to inf
]


def test_bf16_golden() -> None:
    out = serve("bf16", [[v for v, _ in BF16_CASES]])
    assert out["w.weight"].dtype == torch.bfloat16
    assert u16(out["w.weight"]) == [b for _, b in BF16_CASES]


FP16_CASES = [
    (0.0, 0x0000),
    (-0.0, 0x8000),
    (1.0, 0x3C00),
    (1 + 2**-11, 0x3C00),  # tie -> even
    (1 + 3 * 2**-11, 0x3C02),  # tie -> even
    (65504.0, 0x7BFF),  # max finite
    (65519.0, 0x7BFF),  # below the 65520 tie, rounds down
    (2.0**-14, 0x0400),  # min normal
    (2.0**-24, 0x0001),  # min subnormal
    (2.0**-25, 0x0000),  # tie between 0 and 2**-24 -> even (0)
    (3 * 2.0**-25, 0x0002),  # tie between 1 and 2 -> even
    (-(2.0**-26), 0x8000),  # underflows to -0
]


def test_fp16_golden() -> None:
    out = serve("fp16", [[v for v, _ in FP16_CASES]])
    assert out["w.weight"].dtype == torch.float16
    assert u16(out["w.weight"]) == [b for _, b in FP16_CASES]


@pytest.mark.parametrize(
    ("fmt", "value"),
    [("fp16", 65520.0), ("fp16", -1e6), ("bf16", f32_from_bits(0x7F7F8000)), ("mxfp8", 3.4e38)],
)
def test_overflow_to_inf_is_refused(fmt: str, value: float) -> None:
    with pytest.raises(FormatError, match=r"w\.weight.*overflow"):
        serve(fmt, [[1.0, value]])


# --- fp8-tensor --------------------------------------------------------------------------------------


def test_fp8_tensor_golden() -> None:
    # amax = 448 -> scale = 1.0, inv = 1.0: each byte is the plain e4m3 RNE of the value.
    cases = [
        (448.0, 0x7E),  # max finite: e=15, m=6
        (-448.0, 0xFE),
        (0.0, 0x00),
        (-0.0, 0x80),  # -0 kept
        (1.0, 0x38),  # e=7, m=0
        (1.0625, 0x38),  # tie 1.0 / 1.125 -> even m=0
        (1.1875, 0x3A),  # tie 1.125 / 1.25 -> even m=2
        (2.0**-9, 0x01),  # min subnormal
        (2.0**-10, 0x00),  # tie 0 / 2**-9 -> even 0
        (3 * 2.0**-10, 0x02),  # tie 1 / 2 (subnormal codes) -> even
        (-(2.0**-11), 0x80),  # rounds to -0
        (240.0, 0x77),  # 128 * 1.875: e=14, m=7
        (232.0, 0x76),  # tie 224 / 240 -> even m=6
        (248.0, 0x78),  # tie 240 / 256 -> 256 (e=15, m=0)
    ]
    out = serve("fp8-tensor", [[v for v, _ in cases]])
    assert out["w.weight"].dtype == torch.float8_e4m3fn
    assert u8(out["w.weight"]) == [b for _, b in cases]
    assert out["w.weight_scale"].shape == (1,)
    assert u32(out["w.weight_scale"]) == [0x3F800000]


def test_fp8_tensor_all_zero_gives_0x7e_bytes_and_zero_scale() -> None:
    # scale 0 -> inv = inf -> 0 * inf = NaN -> fminf(NaN, 448) = 448: the CUDA kernel's 0x7E bytes.
    out = serve("fp8-tensor", torch.zeros(2, 3))
    assert u8(out["w.weight"]) == [0x7E] * 6
    assert u32(out["w.weight_scale"]) == [0]
    negative = serve("fp8-tensor", torch.full((1, 2), -0.0))
    assert u8(negative["w.weight"]) == [0x7E] * 2


def test_fp8_tensor_outlier() -> None:
    # amax = 2**20 -> scale = fl(2**20 / 448); 1 * inv ~ 4.3e-4 < 2**-11 flushes to (-)0;
    # 4096 * inv ~ 1.75 -> 0x3E (e=7, m=6); the outlier -> ~448 -> 0x7E.
    out = serve("fp8-tensor", [[2.0**20, 1.0, -1.0, 4096.0]])
    assert u8(out["w.weight"]) == [0x7E, 0x00, 0x80, 0x3E]
    scale = np.float32(2.0**20) / np.float32(448.0)
    assert u32(out["w.weight_scale"]) == [int(np.array([scale], np.float32).view(np.uint32)[0])]


# --- fp8-channel -----------------------------------------------------------------------------------


def test_fp8_channel_golden() -> None:
    rows = [
        [448.0, -1.0, 1.0625, -0.0],  # scale 1.0 -> 0x7E, 0xB8, 0x38 (tie -> even), 0x80
        [0.0, 0.0, -0.0, 0.0],  # all zero: scale = fp32 eps 2**-23, q = x / eps = (-)0
        [896.0, 448.0, 8.0, 1.0],  # scale 2.0 -> 448 0x7E, 224 0x76, 4 0x48 (e=9), 0.5 0x30 (e=6)
        [2.0**-20, 0.0, 0.0, 0.0],  # no floor: scale = 2**-20/448, q = 448 -> 0x7E
    ]
    out = serve("fp8-channel", rows)
    assert u8(out["w.weight"]) == [
        0x7E, 0xB8, 0x38, 0x80,
        0x00, 0x00, 0x80, 0x00,
        0x7E, 0x76, 0x48, 0x30,
        0x7E, 0x00, 0x00, 0x00,
    ]  # fmt: skip
    assert out["w.weight_scale"].shape == (4, 1)
    tiny = np.array([np.float32(2.0**-20) / np.float32(448.0)], np.float32).view(np.uint32)[0]
    assert u32(out["w.weight_scale"]) == [0x3F800000, 0x34000000, 0x40000000, int(tiny)]


# --- int8-channel ----------------------------------------------------------------------------------


def test_int8_channel_golden() -> None:
    rows = [
        # scale 127.5 / 127.5 = 1: 127.5 clamps to 127; -127.5 rounds half to even, to -128; ties 0.5 -> 0,
        # 1.5 -> 2, 2.5 -> 2, -0.5 -> 0; -0.0 -> 0; 63.75 -> 64
        [127.5, -127.5, 0.5, -0.0, 1.5, 2.5, -0.5, 63.75],
        [0.0, 0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all zero: scale = fp32 eps 2**-23, q = 0
        [255.0, 1.0, -1.0, 0.75, 100.0, -254.0, 3.0, 0.0],  # scale 2: 127.5 -> 127, 0.5 -> 0, -127 -> 0x81
        [2.0**-20, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # no floor: scale = 2**-20 / 127.5, q = 127
    ]
    out = serve("int8-channel", rows)
    assert out["w.weight"].dtype == torch.int8
    assert u8(out["w.weight"]) == [
        0x7F, 0x80, 0x00, 0x00, 0x02, 0x02, 0x00, 0x40,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x7F, 0x00, 0x00, 0x00, 0x32, 0x81, 0x02, 0x00,
        0x7F, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ]  # fmt: skip
    assert out["w.weight_scale"].shape == (4, 1) and out["w.weight_scale"].dtype == torch.float32
    tiny = np.array([np.float32(2.0**-20) / np.float32(127.5)], np.float32).view(np.uint32)[0]
    assert u32(out["w.weight_scale"]) == [0x3F800000, 0x34000000, 0x40000000, int(tiny)]
    back = dequantize_view(out, "int8-channel")["w.weight"]
    assert back[0].tolist() == [127.0, -128.0, 0.0, 0.0, 2.0, 2.0, 0.0, 64.0]


def test_int8_channel_keeps_what_engines_keep() -> None:
    """Norms, embeddings, the LM head and 1-D tensors stay bf16, as a compressed-tensors W8A8 checkpoint has them."""
    masters = {
        "model.embed_tokens.weight": torch.randn(8, 4),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8),
        "model.layers.0.input_layernorm.weight": torch.randn(4),
        "lm_head.weight": torch.randn(8, 4),
    }
    out = served_view(masters, "int8-channel")
    assert {k: v.dtype for k, v in out.items()} == {
        "model.embed_tokens.weight": torch.bfloat16,
        "model.layers.0.mlp.down_proj.weight": torch.int8,
        "model.layers.0.mlp.down_proj.weight_scale": torch.float32,
        "model.layers.0.input_layernorm.weight": torch.bfloat16,
        "lm_head.weight": torch.bfloat16,
    }


# --- fp8-block -------------------------------------------------------------------------------------


def test_fp8_block_golden() -> None:
    x = torch.zeros(130, 260)  # tiles: 2 x 3, the last row and column of tiles partial
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 1.0, 1.0625  # tile (0,0): sf = 1 -> 0x7E, 0x38, 0x38 (tie)
    x[0, 128] = 2.0**-20  # tile (0,1): amax floored at 1e-4; 2**-20 * 448/1e-4 = 4.27 -> 4.5 = 0x49
    x[129, 0], x[128, 5] = -896.0, 3.0  # tile (1,0): sf = 2 -> -448 = 0xFE, 1.5 = 0x3C (e=7, m=4)
    out = serve("fp8-block", x)
    q = out["w.weight"]
    assert q.shape == (130, 260) and q.dtype == torch.float8_e4m3fn
    assert u8(q[0, :3]) == [0x7E, 0x38, 0x38]
    assert u8(q[0, 128:129]) == [0x49]
    assert u8(q[129, :1]) == [0xFE] and u8(q[128, 5:6]) == [0x3C]
    assert int(torch.count_nonzero(q.view(torch.uint8))) == 6
    floor = np.float32(np.float32(1e-4) / np.float32(448.0))
    floor_bits = int(np.array([floor], np.float32).view(np.uint32)[0])
    sf = out["w.weight_scale_inv"]
    assert sf.shape == (2, 3) and sf.dtype == torch.float32
    assert u32(sf) == [0x3F800000, floor_bits, floor_bits, 0x40000000, floor_bits, floor_bits]


# --- mxfp8 -------------------------------------------------------------------------------------------


def test_mxfp8_golden() -> None:
    row0 = [0.0] * 40
    # block 0: amax 1.9375 has exponent 0 -> scale exponent 0 - 8 -> byte 119; y = x * 256
    row0[:8] = [1.0, 1.75, 1.9375, 1.0625, 2.0**-17, 2.0**-18, -0.0, 3 * 2.0**-18]
    # block 1 (partial, 8 elements): amax 2**-10 -> byte -10 - 8 + 127 = 109; y = x * 2**18
    row0[32:34] = [2.0**-10, -(2.0**-11)]
    row1 = [0.0] * 40  # all-zero blocks: byte 0 (torchao), elements 0
    row2 = [0.0] * 40
    row2[0] = 2.0**-120  # exponent -128 clamps to -127 (byte 0); torchao divides by 2**-126 -> 64 = 0x68
    out = serve("mxfp8", [row0, row1, row2])
    q = u8(out["w.weight"])
    assert out["w.weight"].shape == (3, 40)
    assert q[:8] == [
        0x78,  # 256 = 2**8: e=15, m=0
        0x7E,  # 448
        0x7E,  # 496 saturates to 448 (FLOOR lets |y| reach 512)
        0x78,  # 272: tie 256 / 288 -> even
        0x01,  # 2**-9
        0x00,  # 2**-10: tie -> 0
        0x80,  # -0.0
        0x02,  # 3 * 2**-10: tie -> even
    ]
    assert q[32:34] == [0x78, 0xF0]  # 256; -128 (e=14, m=0, sign)
    assert q[40:80] == [0] * 40
    assert q[80] == 0x68
    assert out["w.weight_scale"].dtype == torch.uint8
    assert u8(out["w.weight_scale"]) == [119, 109, 0, 0, 0, 0]


# --- mxfp4 -------------------------------------------------------------------------------------------


def test_mxfp4_golden() -> None:
    block0 = [6.0, 5.0, 0.25, 0.75, -0.0, -0.1, 7.0, 1.25, 1.75, 2.5, 3.5, -3.0, 0.5, -6.0] + [0.0] * 18
    # amax 7 has exponent 2 -> scale exponent 2 - 2 = 0 -> byte 127; y = x.
    # codes: 6->7, 5->6 (tie 4/6 -> even), .25->0 (tie), .75->2 (tie -> 1.0), -0.0->8 (sign kept),
    # -0.1->8, 7->7 (saturates), 1.25->2, 1.75->4, 2.5->4, 3.5->6, -3->0xD, .5->1, -6->0xF
    block1 = [1.0, -0.5]  # partial block: amax 1 -> exponent -2 -> byte 125; y = 4x -> 4 (6), -2 (0xC)
    out = serve("mxfp4", [block0 + block1])
    assert out["w.weight"].shape == (1, 17) and out["w.weight"].dtype == torch.uint8
    assert u8(out["w.weight"]) == [0x67, 0x20, 0x88, 0x27, 0x44, 0xD6, 0xF1] + [0x00] * 9 + [0xC6]
    assert u8(out["w.weight_scale"]) == [127, 125]


def test_mxfp4_outlier_only_affects_its_block() -> None:
    row = [2.0**20, 1.0] + [0.0] * 30 + [1.0, 1.5]
    # block 0: exponent 20 -> byte 145, y = x / 2**18: 4 -> code 6, 1 * 2**-18 -> 0
    # block 1: amax 1.5 -> exponent 0 -> byte 125, y = 4x: 4 -> 6, 6 -> 7
    out = serve("mxfp4", [row])
    assert u8(out["w.weight_scale"]) == [145, 125]
    assert u8(out["w.weight"]) == [0x06] + [0x00] * 15 + [0x76]


# --- nvfp4 -------------------------------------------------------------------------------------------


def test_nvfp4_golden() -> None:
    blocks = [
        [2688.0, -1344.0] + [0.0] * 14,  # global amax 2688 -> s2 = 1; bs = 448 (0x7E); y = 6, -3
        [6.0, 5.0, 0.25, 0.75, -0.0, -0.1, 1.25, 1.75, 2.5, 3.5, -3.0, 0.5, -6.0, 0.0, 0.0, 0.0],
        [0.0] * 16,  # all-zero block: bs = 0 -> 1.0 (0x38), codes 0
        [6 * 2.0**-12] + [0.0] * 15,  # bs = 2**-12 floored to 2**-9 (0x01); y = 0.75 -> code 2
        [6.375] + [0.0] * 15,  # bs = 1.0625: e4m3 tie -> 1.0 (0x38); y = 6.375 saturates -> 7
    ]
    out = serve("nvfp4", [[v for block in blocks for v in block]])
    payload = u8(out["w.weight"])
    assert out["w.weight"].shape == (1, 40)
    assert payload[0:8] == [0xD7] + [0x00] * 7
    # block 1, s2 = 1, bs = 1: 6->7, 5->6, .25->0, .75->2, -0.0->0 (ModelOpt: y < 0 is False),
    # -0.1->8, 1.25->2, 1.75->4, 2.5->4, 3.5->6, -3->0xD, .5->1, -6->0xF, 0, 0, 0
    assert payload[8:16] == [0x67, 0x20, 0x80, 0x42, 0x64, 0x1D, 0x0F, 0x00]
    assert payload[16:24] == [0x00] * 8
    assert payload[24:32] == [0x02] + [0x00] * 7
    assert payload[32:40] == [0x07] + [0x00] * 7
    assert out["w.weight_scale"].dtype == torch.float8_e4m3fn
    assert u8(out["w.weight_scale"]) == [0x7E, 0x38, 0x38, 0x01, 0x38]
    assert u32(out["w.weight_scale_2"]) == [0x3F800000]


def test_nvfp4_all_zero_tensor() -> None:
    out = serve("nvfp4", torch.zeros(2, 32))
    assert u8(out["w.weight"]) == [0] * 32
    assert u8(out["w.weight_scale"]) == [0x38] * 4  # 1.0
    assert u32(out["w.weight_scale_2"]) == [0x3F800000]  # defined as 1.0 (amax/2688 would be 0 -> NaN)
    neg = serve("nvfp4", torch.full((1, 16), -0.0))
    assert u8(neg["w.weight"]) == [0] * 8  # -0.0 encodes as +0 in ModelOpt form


def test_nvfp4_partial_block() -> None:
    # amax 3 -> s2 = fl(3/2688); block 1 (2 elements): bs ~ 448 -> 0x7E, y ~ (6, -3) -> codes 7, 0xD
    out = serve("nvfp4", [[0.0] * 16 + [3.0, -1.5]])
    assert out["w.weight"].shape == (1, 9) and out["w.weight_scale"].shape == (1, 2)
    assert u8(out["w.weight"]) == [0x00] * 8 + [0xD7]
    assert u8(out["w.weight_scale"]) == [0x38, 0x7E]
    s2 = np.array([np.float32(3.0) / np.float32(2688.0)], np.float32).view(np.uint32)[0]
    assert u32(out["w.weight_scale_2"]) == [int(s2)]


# --- default input is bf16(master) ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-channel", "fp8-block", "mxfp8"])
def test_bf16_input_rounding_is_part_of_the_recipe(fmt: str) -> None:
    # v = 1.0625 + 2**-12 is not a bf16 value: bf16 rounds it to 1.0625, an e4m3 tie between 1.0 and
    # 1.125 that goes to 1.0 (0x38); from fp32 it is above the tie: 1.125 (0x39). mxfp8 (amax < 2)
    # scales by 2**8: 272 is the tie 256 (0x78) / 288 (0x79).
    v = 1.0625 + 2**-12
    x = torch.tensor([[1.0 if fmt == "mxfp8" else 448.0, v]])
    via_bf16 = get_format(fmt).quantize("w.weight", x)["w.weight"]
    direct = get_format(fmt).quantize("w.weight", x, from_fp32=True)["w.weight"]
    low, high = (0x78, 0x79) if fmt == "mxfp8" else (0x38, 0x39)
    assert u8(via_bf16)[1] == low
    assert u8(direct)[1] == high
