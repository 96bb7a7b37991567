"""Block-scaled FP4/FP8 codecs (engine_adapter/ced/codecs.py) against ENGINE.md §3.

The references here are independent of the code under test: E2M1 rounding is a brute-force
nearest search over the grid in float64 with an explicit tie rule, E4M3 scale rounding is a
search over all 127 finite positive E4M3 values, and E8M0 exponents come from math.frexp.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_adapter.ced import codecs as C

GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FAST = settings(max_examples=60, deadline=None)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---------------------------------------------------------------------------------------------
# Independent references


def ref_e2m1(y: torch.Tensor) -> torch.Tensor:
    """float64 value nearest to clamp(y, -6, 6) on the grid; a tie picks the even index."""
    yc = y.double().clamp(-6.0, 6.0)
    grid = torch.tensor(GRID, dtype=torch.float64)
    dist = (yc.abs().unsqueeze(-1) - grid).abs()
    best = dist == dist.amin(dim=-1, keepdim=True)
    even = best & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(-1), even.double().argmax(-1), best.double().argmax(-1))
    return grid[idx] * torch.where(yc < 0, -1.0, 1.0)


E4M3_POSITIVE = [float(v) for v in torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()]


def ref_e4m3_scale(amax: float) -> tuple[float, int]:
    """(value, bits) of e4m3(max(amax, 6*2**-9) / 6), RNE by table search, saturating at 448."""
    q = float(torch.tensor(max(amax, 6 * 2.0**-9), dtype=torch.float32) / 6)  # the float32 division
    if q >= 448.0:
        return 448.0, 0x7E
    dists = [abs(q - v) for v in E4M3_POSITIVE]
    best = min(dists)
    bits = [b for b, d in enumerate(dists) if d == best]
    pick = next((b for b in bits if b % 2 == 0), bits[0])
    return E4M3_POSITIVE[pick], pick


def ref_e8m0_scale(amax: float, floor: float = 6 * 2.0**-126, qmax: float = 6.0) -> tuple[float, int]:
    """(value, biased byte) of 2**ceil(log2(max(amax, floor) / qmax)), exactly via frexp."""
    q = float(torch.tensor(max(amax, floor), dtype=torch.float32) / qmax)
    mant, exp = math.frexp(q)  # q = mant * 2**exp, mant in [0.5, 1)
    ceil_log2 = exp - 1 if mant == 0.5 else exp
    return math.ldexp(1.0, ceil_log2), ceil_log2 + 127


def e2m1_half_gap(a: torch.Tensor) -> torch.Tensor:
    """Largest rounding error (scaled units) for |y| = a within [0, 6]: half the local grid gap."""
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)).double()


# ---------------------------------------------------------------------------------------------
# Random inputs: random shapes, magnitudes and block contents


@st.composite
def block_tensors(draw: st.DrawFn, blocks: tuple[int, ...] = (16, 32)) -> tuple[torch.Tensor, int]:
    block = draw(st.sampled_from(blocks))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    num_blocks = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    exponent = draw(st.integers(-40, 40))
    kind = draw(st.sampled_from(["normal", "heavy", "sparse", "grid", "const"]))
    gen = torch.Generator().manual_seed(seed)
    shape = (*lead, num_blocks * block)
    x = torch.randn(shape, generator=gen)
    if kind == "heavy":
        x = x**3
    elif kind == "sparse":
        x = x * (torch.rand(shape, generator=gen) < 0.2)
    elif kind == "grid":  # exact grid points and ties, so rounding decisions are on the edge
        x = torch.randint(-24, 25, shape, generator=gen).float() / 4
    elif kind == "const":
        x = torch.full(shape, float(torch.randn(1, generator=gen)))
    return x * 2.0**exponent, block


def blocks_of(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(-1, block)


# ---------------------------------------------------------------------------------------------
# E2M1 codes


def test_e2m1_values_table() -> None:
    assert C.E2M1_VALUES[:8] == GRID
    assert C.E2M1_VALUES[8:] == tuple(-v for v in GRID)
    decoded = C.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert decoded.tolist() == list(C.E2M1_VALUES)


def test_every_code_round_trips_decode_encode() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    again = C.e2m1_encode(C.e2m1_decode(codes))
    expected = codes.clone()
    assert again[8].item() in (0, 8)  # -0.0 may encode either way ...
    expected[8] = again[8]
    assert torch.equal(again, expected)
    assert C.e2m1_decode(again)[8].item() == 0.0  # ... but must decode to zero


@pytest.mark.parametrize(("value", "expected"), [
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    (-0.75, -1.0), (-1.25, -1.0), (-1.75, -2.0), (-2.5, -2.0), (-3.5, -4.0), (-5.0, -4.0),
])
def test_ties_round_to_even_code(value: float, expected: float) -> None:
    code = C.e2m1_encode(torch.tensor([value]))
    assert C.e2m1_decode(code).item() == expected
    assert code.item() & 1 == 0 or expected == 0.0


def test_encode_matches_reference_near_every_threshold() -> None:
    quarters = torch.arange(-28, 29, dtype=torch.float32) / 4  # every tie point, and beyond +-6
    up = torch.nextafter(quarters, torch.tensor(math.inf))
    down = torch.nextafter(quarters, torch.tensor(-math.inf))
    fine = torch.arange(-7 * 4096, 7 * 4096 + 1, dtype=torch.float32) / 4096
    y = torch.cat([quarters, up, down, fine, torch.tensor([-0.0, 1e-30, -1e-30, 1e30, -1e30])])
    got = C.e2m1_decode(C.e2m1_encode(y)).double()
    assert torch.equal(got, ref_e2m1(y))


def test_encode_saturates_and_defines_nonfinite() -> None:
    y = torch.tensor([7.0, -7.0, math.inf, -math.inf, 6.0, -6.0, math.nan])
    assert C.e2m1_encode(y).tolist() == [7, 15, 7, 15, 7, 15, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_encode_decode_other_dtypes(dtype: torch.dtype) -> None:
    y = torch.tensor(GRID + (0.25, 0.75, -5.0), dtype=dtype)
    codes = C.e2m1_encode(y)
    assert C.e2m1_decode(codes, dtype).dtype == dtype
    assert C.e2m1_decode(codes, dtype).tolist() == list(GRID) + [0.0, 1.0, -4.0]


def test_encode_rejects_non_float() -> None:
    with pytest.raises(ValueError, match="floating tensor, got dtype|floating tensor, got torch.int64"):
        C.e2m1_encode(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="codes must be a uint8 tensor, got torch.int64"):
        C.e2m1_decode(torch.tensor([1, 2]))


# ---------------------------------------------------------------------------------------------
# Nibble packing


def test_pack_puts_element_2i_in_low_nibble() -> None:
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 0, 15]], dtype=torch.uint8)
    assert C.pack_e2m1(codes).tolist() == [[0x21, 0x43, 0x0F, 0xF0]]
    packed = torch.tensor([0xA5, 0x70], dtype=torch.uint8)
    assert C.unpack_e2m1(packed).tolist() == [0x5, 0xA, 0x0, 0x7]


@FAST
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_are_inverse(shape: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape[-1] *= 2
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8)
    packed = C.pack_e2m1(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(C.unpack_e2m1(packed), codes)
    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    assert torch.equal(C.pack_e2m1(C.unpack_e2m1(raw)), raw)


def test_pack_validates() -> None:
    with pytest.raises(ValueError, match="last dim 3 must be even"):
        C.pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes must be a uint8 tensor, got torch.int32"):
        C.pack_e2m1(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="packed must have at least 1 dim"):
        C.unpack_e2m1(torch.tensor(3, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------
# Scale formulas on edge values


def test_e4m3_zero_block_scale_is_smallest_subnormal() -> None:
    x = torch.zeros(2, 32)
    assert torch.equal(C.e4m3_block_scales(x), torch.full((2, 2), 2.0**-9))
    p = C.quantize_fp4_e4m3(x)
    assert p.scales.tolist() == [[0x01, 0x01]] * 2  # E4M3 bits of 2**-9
    assert not p.codes.any()
    assert torch.equal(C.dequantize_fp4(p), x)


def test_e4m3_amax_at_floor() -> None:
    x = torch.zeros(16)
    x[3], x[5] = 6 * 2.0**-9, -3 * 2.0**-9
    assert C.e4m3_block_scales(x).tolist() == [2.0**-9]
    p = C.quantize_fp4_e4m3(x)
    assert C.unpack_e2m1(p.codes)[[3, 5]].tolist() == [7, 13]  # +6 and -3
    assert torch.equal(C.dequantize_fp4(p), x)


def test_e4m3_scale_saturates_above_448_times_6() -> None:
    x = torch.linspace(-1e4, 1e4, 16)
    assert C.e4m3_block_scales(x).tolist() == [448.0]
    p = C.quantize_fp4_e4m3(x)
    assert p.scales.tolist() == [0x7E]  # 448, the largest finite E4M3
    codes = C.unpack_e2m1(p.codes)
    assert codes[0].item() == 15 and codes[-1].item() == 7  # clamped to -6 and +6
    assert C.dequantize_fp4(p)[[0, -1]].tolist() == [-2688.0, 2688.0]


def test_e4m3_scale_rounding_down_clamps_values() -> None:
    # amax/6 = 1.0625 is an E4M3 tie between 1.0 and 1.125: RNE picks 1.0, so 6.375 clamps to 6.
    x = torch.zeros(16)
    x[0] = 6.375
    assert C.e4m3_block_scales(x).tolist() == [1.0]
    assert C.dequantize_fp4(C.quantize_fp4_e4m3(x))[0].item() == 6.0


@pytest.mark.parametrize(("amax", "scale"), [
    (0.0, 2.0**-126), (6 * 2.0**-126, 2.0**-126), (6.0, 1.0), (3.0, 0.5), (12.0, 2.0),
    (6 * 2.0**20, 2.0**20), (6 * 2.0**-30, 2.0**-30),
    (float(torch.nextafter(torch.tensor(6.0), torch.tensor(7.0))), 2.0),  # just above: next power
    (float(torch.nextafter(torch.tensor(6.0), torch.tensor(0.0))), 1.0),
    # log2 would round this to exactly 20 and lose the ceiling
    (float(torch.nextafter(torch.tensor(6 * 2.0**20), torch.tensor(math.inf))), 2.0**21),
])
def test_e8m0_scale_edges(amax: float, scale: float) -> None:
    x = torch.zeros(32)
    x[7] = -amax
    assert C.e8m0_block_scales(x).tolist() == [scale]
    p = C.quantize_fp4_e8m0(x)
    assert p.scales.tolist() == [int(math.log2(scale)) + 127]


def test_e8m0_zero_block_dequantizes_to_zero() -> None:
    p = C.quantize_fp4_e8m0(torch.zeros(3, 64))
    assert p.scales.tolist() == [[1, 1]] * 3  # 2**-126
    assert not C.dequantize_fp4(p).any()


def test_nan_block_stays_nan_and_codes_stay_in_range() -> None:
    x = torch.ones(2, 32)
    x[0, 4] = math.nan
    for p in (C.quantize_fp4_e4m3(x), C.quantize_fp4_e8m0(x)):
        out = C.dequantize_fp4(p)
        assert out[0, :16].isnan().all() and not out[1].isnan().any()
    fp8 = C.quantize_fp8_e8m0(x)
    assert fp8.scales[0, 0].item() == 255 and C.dequantize_fp8(fp8)[0].isnan().all()


@FAST
@given(data=block_tensors(blocks=(16,)))
def test_e4m3_scales_match_reference(data: tuple[torch.Tensor, int]) -> None:
    x, block = data
    amax = blocks_of(x, block).abs().amax(-1).tolist()
    expected = [ref_e4m3_scale(a) for a in amax]
    p = C.quantize_fp4_e4m3(x, block)
    assert C.e4m3_block_scales(x, block).flatten().tolist() == [v for v, _ in expected]
    assert p.scales.flatten().tolist() == [b for _, b in expected]


@FAST
@given(data=block_tensors(blocks=(32,)))
def test_e8m0_scales_match_reference(data: tuple[torch.Tensor, int]) -> None:
    x, block = data
    amax = blocks_of(x, block).abs().amax(-1).tolist()
    expected = [ref_e8m0_scale(a) for a in amax]
    assert C.e8m0_block_scales(x, block).flatten().tolist() == [v for v, _ in expected]
    assert C.quantize_fp4_e8m0(x, block).scales.flatten().tolist() == [b for _, b in expected]


# ---------------------------------------------------------------------------------------------
# Round-trip error and exact rounding on random tensors


def assert_fp4_round_trip(x: torch.Tensor, p: C.PackedFP4) -> None:
    """Every element is the nearest-even grid value of x / s, and the error meets the bound.

    Bound per element in scaled units: half the local grid gap (0.25 below 2, 0.5 below 4, 1 up
    to 6) while |x / s| <= 6, else exactly the clamping error |x / s| - 6; plus one float32 ulp
    of x / s for the rounding of the division itself.
    """
    scale = C.dequantize_fp4(C.PackedFP4(torch.full_like(p.codes, 0x22), p.scales, p.block, p.scale_format))
    scale = scale.double()  # each element's block scale (code 2 decodes to 1.0)
    out = C.dequantize_fp4(p).double()
    y32 = x.float() / scale.float()
    assert torch.equal(out / scale, ref_e2m1(y32)), "not the nearest-even grid point of x/s"
    y = x.double() / scale
    bound = torch.where(y.abs() > 6, y.abs() - 6, e2m1_half_gap(y.abs())) + y.abs() * 2.0**-23
    err = (x.double() - out).abs() / scale
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@settings(max_examples=100, deadline=None)
@given(data=block_tensors())
def test_fp4_e4m3_round_trip_error_bound(data: tuple[torch.Tensor, int]) -> None:
    x, block = data
    p = C.quantize_fp4_e4m3(x, block)
    assert p.codes.shape == (*x.shape[:-1], x.shape[-1] // 2)
    assert p.scales.shape == (*x.shape[:-1], x.shape[-1] // block)
    assert_fp4_round_trip(x, p)


@settings(max_examples=100, deadline=None)
@given(data=block_tensors())
def test_fp4_e8m0_round_trip_error_bound(data: tuple[torch.Tensor, int]) -> None:
    x, block = data
    p = C.quantize_fp4_e8m0(x, block)
    assert_fp4_round_trip(x, p)
    # A power-of-two scale never rounds below amax/6: no element is clamped.
    scale = C.e8m0_block_scales(x, block).double()
    assert (blocks_of(x, block).abs().amax(-1).double() <= 6 * scale.flatten()).all()


@FAST
@given(data=block_tensors(blocks=(32,)))
def test_fp8_round_trip_error_bound(data: tuple[torch.Tensor, int]) -> None:
    x, block = data
    p = C.quantize_fp8_e8m0(x, block)
    scale = torch.tensor([ref_e8m0_scale(a, 448 * 2.0**-126, 448.0)[0]
                          for a in blocks_of(x, block).abs().amax(-1).tolist()], dtype=torch.float64)
    assert torch.equal(C.dequantize_fp8(C.PackedFP8(torch.full_like(p.values, 0x38), p.scales, block)).double(),
                       scale.repeat_interleave(block).reshape(x.shape))  # 0x38 is E4M3 1.0
    y = blocks_of(x.double(), block) / scale.unsqueeze(-1)
    amax_y = y.abs().amax(-1)
    assert (amax_y <= 448).all()
    assert ((amax_y > 224) | (scale == 2.0**-126)).all(), "scale is not the smallest power of two"
    # E4M3: 3 mantissa bits, so half an ulp is <= |y| / 16 (normal) or 2**-10 (subnormal).
    err = (blocks_of(x.double(), block) - blocks_of(C.dequantize_fp8(p).double(), block)).abs()
    bound = torch.maximum(y.abs() / 16, torch.tensor(2.0**-10)) * (1 + 2.0**-20) * scale.unsqueeze(-1)
    assert (err <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_input_quantizes_as_its_float32_upcast(dtype: torch.dtype) -> None:
    x = (torch.randn(3, 64, generator=torch.Generator().manual_seed(1)) * 5).to(dtype)
    a, b = C.quantize_fp4_e4m3(x), C.quantize_fp4_e4m3(x.float())
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    out = C.dequantize_fp4(a, dtype)
    assert out.dtype == dtype
    assert torch.equal(out, C.dequantize_fp4(a).to(dtype))


def test_non_contiguous_input_and_no_mutation() -> None:
    x = torch.randn(64, 5, generator=torch.Generator().manual_seed(2))
    before = x.clone()
    a, b = C.quantize_fp4_e8m0(x.t()), C.quantize_fp4_e8m0(x.t().contiguous())
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert torch.equal(x, before)


@pytest.mark.parametrize("shape", [(64,), (2, 3, 64), (0, 64), (4, 0, 64)])
def test_any_leading_shape(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape)
    for p in (C.quantize_fp4_e4m3(x), C.quantize_fp4_e8m0(x)):
        assert C.dequantize_fp4(p).shape == x.shape
    assert C.dequantize_fp8(C.quantize_fp8_e8m0(x)).shape == x.shape


# ---------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(("fn", "x", "block", "message"), [
    (C.quantize_fp4_e4m3, torch.zeros(4, 40), 16,
     "quantize_fp4_e4m3: last dim 40 must be a positive multiple of block=16"),
    (C.quantize_fp4_e8m0, torch.zeros(4, 64, dtype=torch.int32), 32,
     "quantize_fp4_e8m0: expected a floating tensor, got dtype torch.int32"),
    (C.quantize_fp4_e4m3, torch.zeros(9), 3, "quantize_fp4_e4m3: last dim 9 must be even"),
    (C.quantize_fp4_e4m3, torch.tensor(1.0), 16, "quantize_fp4_e4m3: expected at least 1 dim"),
    (C.quantize_fp8_e8m0, torch.zeros(4, 64), 0, "quantize_fp8_e8m0: block must be a positive int, got 0"),
    (C.e4m3_block_scales, torch.zeros(2, 0), 16, "e4m3_block_scales: last dim 0 must be a positive multiple"),
])
def test_quantize_validates_input(fn, x: torch.Tensor, block: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fn(x, block)


def test_packed_containers_validate() -> None:
    codes, scales = torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale_format must be one of"):
        C.PackedFP4(codes, scales, 16, "e5m2")
    with pytest.raises(ValueError, match=r"64 values need 2 scales of block=32, got 4"):
        C.PackedFP4(codes, scales, 32, "e8m0")
    with pytest.raises(ValueError, match="disagree on the leading shape"):
        C.PackedFP4(codes, scales[:1], 16, "e4m3")
    with pytest.raises(ValueError, match="values must be a uint8 tensor"):
        C.PackedFP8(codes.float(), scales, 8)


# ---------------------------------------------------------------------------------------------
# Row sizes and bytes


@pytest.mark.parametrize(("dim", "block", "quantize", "row_bytes"), [
    (512, 16, C.quantize_fp4_e4m3, 288),
    (128, 32, C.quantize_fp4_e8m0, 68),
    (128, 16, C.quantize_fp4_e4m3, 72),
    (64, 32, C.quantize_fp4_e8m0, 34),
])
def test_fp4_bytes_per_row(dim: int, block: int, quantize, row_bytes: int) -> None:
    p = quantize(torch.randn(3, dim), block)
    assert C.fp4_row_bytes(dim, block) == row_bytes
    assert p.nbytes_per_row() == row_bytes
    assert len(C.to_bytes(p)) == 3 * row_bytes


def test_fp8_bytes_per_row() -> None:
    p = C.quantize_fp8_e8m0(torch.randn(3, 512))
    assert C.fp8_row_bytes(512, 32) == 528 == p.nbytes_per_row()
    assert len(C.to_bytes(p)) == 3 * 528


def test_row_bytes_validate() -> None:
    with pytest.raises(ValueError, match="fp4_row_bytes: dim must be a positive even multiple of block=16, got 100"):
        C.fp4_row_bytes(100, 16)
    with pytest.raises(ValueError, match="fp4_row_bytes: block must be a positive int, got 0"):
        C.fp4_row_bytes(64, 0)


def test_to_bytes_layout_is_one_entry_per_row() -> None:
    codes = torch.tensor([[0x10, 0x32], [0x54, 0x76]], dtype=torch.uint8)  # d = 4, block = 2
    scales = torch.tensor([[0xA0, 0xA1], [0xB0, 0xB1]], dtype=torch.uint8)
    buf = C.to_bytes(C.PackedFP4(codes, scales, 2, "e4m3"))
    assert buf == bytes([0x10, 0x32, 0xA0, 0xA1, 0x54, 0x76, 0xB0, 0xB1])


@FAST
@given(data=block_tensors(), scheme=st.sampled_from(["e4m3", "e8m0"]))
def test_fp4_bytes_round_trip(data: tuple[torch.Tensor, int], scheme: str) -> None:
    x, block = data
    p = C.quantize_fp4_e4m3(x, block) if scheme == "e4m3" else C.quantize_fp4_e8m0(x, block)
    buf = C.to_bytes(p)
    rows = math.prod(x.shape[:-1])
    back = C.fp4_from_bytes(memoryview(buf), rows, x.shape[-1], block, scheme)
    assert torch.equal(back.codes, p.codes.reshape(rows, -1))
    assert torch.equal(back.scales, p.scales.reshape(rows, -1))
    assert back.codes.is_contiguous() and back.scales.is_contiguous()
    assert torch.equal(C.dequantize_fp4(back), C.dequantize_fp4(p).reshape(rows, -1))
    assert C.to_bytes(back) == buf


def test_fp8_bytes_round_trip() -> None:
    p = C.quantize_fp8_e8m0(torch.randn(2, 3, 64) * 100)
    back = C.fp8_from_bytes(C.to_bytes(p), 6, 64)
    assert torch.equal(back.values, p.values.reshape(6, 64)) and torch.equal(back.scales, p.scales.reshape(6, 2))


def test_from_bytes_validates_length_and_format() -> None:
    buf = bytes(2 * 288)
    expected = r"fp4_from_bytes: buffer holds 576 bytes, expected rows \* row_bytes = 3 \* 288 = 864"
    with pytest.raises(ValueError, match=expected):
        C.fp4_from_bytes(buf, 3, 512, 16, "e4m3")
    with pytest.raises(ValueError, match=r"buffer holds 575 bytes, expected rows \* row_bytes = 2 \* 288 = 576"):
        C.fp4_from_bytes(buf[:-1], 2, 512, 16, "e4m3")
    with pytest.raises(ValueError, match="scale_format must be one of"):
        C.fp4_from_bytes(buf, 2, 512, 16, "fp8")
    with pytest.raises(ValueError, match="dim must be a positive even multiple of block=32, got 48"):
        C.fp4_from_bytes(buf, 2, 48, 32, "e8m0")
    with pytest.raises(ValueError, match="rows must be a non-negative int, got -1"):
        C.fp4_from_bytes(b"", -1, 512, 16, "e4m3")
    empty = C.fp4_from_bytes(b"", 0, 512, 16, "e4m3")
    assert empty.codes.shape == (0, 256) and empty.scales.shape == (0, 32)


# ---------------------------------------------------------------------------------------------
# CUDA: the stored bytes must not depend on the device


def _cuda_inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 512, generator=gen) * torch.logspace(-12, 12, 8).unsqueeze(-1)
    x[0] = 0.0
    x[1, :16] = 1e5  # saturating E4M3 scale
    x[2] = torch.randint(-24, 25, (512,), generator=gen).float() / 4  # ties
    return x


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("quantize", [C.quantize_fp4_e4m3, C.quantize_fp4_e8m0], ids=["e4m3", "e8m0"])
def test_cuda_fp4_matches_cpu_bit_for_bit(quantize) -> None:
    x = _cuda_inputs()
    cpu, gpu = quantize(x), quantize(x.cuda())
    assert torch.equal(gpu.codes.cpu(), cpu.codes) and torch.equal(gpu.scales.cpu(), cpu.scales)
    assert C.to_bytes(gpu) == C.to_bytes(cpu)
    assert torch.equal(C.dequantize_fp4(gpu).cpu(), C.dequantize_fp4(cpu))
    assert torch.equal(C.e2m1_encode(x.cuda() / 7).cpu(), C.e2m1_encode(x / 7))


@pytest.mark.gpu
@requires_cuda
def test_cuda_fp8_matches_cpu_bit_for_bit() -> None:
    x = _cuda_inputs()
    cpu, gpu = C.quantize_fp8_e8m0(x), C.quantize_fp8_e8m0(x.cuda())
    assert torch.equal(gpu.values.cpu(), cpu.values) and torch.equal(gpu.scales.cpu(), cpu.scales)
    assert torch.equal(C.dequantize_fp8(gpu).cpu(), C.dequantize_fp8(cpu))
