"""Triton FP4 codecs against the CPU torch codecs, bit for bit (ENGINE.md §3).

Runs on CUDA; without CUDA it runs only under ``TRITON_INTERPRET=1`` (the kernels then run
in triton's interpreter on CPU tensors), else it is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_adapter.ced import codecs
from engine_adapter.ced import triton_codecs as tc

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not tc.available(DEVICE) or (DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
                       reason="needs CUDA and triton (or TRITON_INTERPRET=1)"),
]
ROWS = 4096 if DEVICE == "cuda" else 48


@pytest.fixture(autouse=True, params=["v1", "v2", "v3", "v5", "v6"])
def variant(request: pytest.FixtureRequest):
    """Every test runs against both kernel variants (they must give the same bits)."""
    saved = tc.set_config(request.param)
    yield request.param
    tc.restore_config(saved)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (so -0.0 != 0.0), except that any NaN equals any NaN: the NaN payload a
    multiply returns differs between CPUs and GPUs, and no reader can tell NaNs apart."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu(), b.cpu()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    if a.is_floating_point():
        nan = a.isnan()
        if not torch.equal(nan, b.isnan()):
            return False
        a, b = a.masked_fill(nan, 0.0), b.masked_fill(nan, 0.0)
    return torch.equal(a.view(ints), b.view(ints))


def _inputs(dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows over 12 decades of scale, plus rows of zeros, NaN, +-inf and exact rounding ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, dim, generator=g) * torch.logspace(-6, 6, ROWS, dtype=torch.float64)[:, None].float()
    x[0] = 0.0
    x[1, :7] = float("nan")
    x[2, 3], x[2, 40 % dim] = float("inf"), float("-inf")
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x[3] = (grid.repeat(dim // 16) * torch.tensor([1.0, -1.0]).repeat_interleave(8).repeat(dim // 16))
    x[4] = x[3] * 2.0 ** -7
    x[5] = torch.linspace(-1e-3, 1e-3, dim)
    x[6] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,dim,block", [("e4m3", 512, 16), ("e8m0", 128, 32), ("e4m3", 128, 16)])
def test_quantize_matches_cpu_codecs(fmt: str, dim: int, block: int, dtype: torch.dtype) -> None:
    x = _inputs(dim, dtype, seed=dim + block)
    ref = (codecs.quantize_fp4_e4m3 if fmt == "e4m3" else codecs.quantize_fp4_e8m0)(x, block)
    got = (tc.quantize_fp4_e4m3 if fmt == "e4m3" else tc.quantize_fp4_e8m0)(x.to(DEVICE), block)
    assert got.scale_format == ref.scale_format and got.block == block
    assert _same(got.scales, ref.scales)
    assert _same(got.codes, ref.codes)


def test_e4m3_scale_rounding_sweep() -> None:
    """Every E4M3 rounding boundary: amax = 6 x (each E4M3 value and the midpoints around it, +-1 ulp)."""
    e4m3 = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = torch.cat([e4m3, (e4m3[1:] + e4m3[:-1]) / 2])
    pts = torch.cat([mids, torch.nextafter(mids, torch.tensor(0.0)), torch.nextafter(mids, torch.tensor(1e9))]) * 6
    pts = pts[(pts > 0) & (pts < 448 * 6)]
    x = torch.zeros(pts.numel(), 16)
    x[:, 0] = pts
    x[:, 1] = -pts / 3
    ref = codecs.quantize_fp4_e4m3(x)
    got = tc.quantize_fp4_e4m3(x.to(DEVICE))
    assert _same(got.scales, ref.scales) and _same(got.codes, ref.codes)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt,dim,block", [("e4m3", 512, 16), ("e8m0", 128, 32)])
def test_dequantize_and_fused_gather_match(fmt: str, dim: int, block: int, out_dtype: torch.dtype) -> None:
    x = _inputs(dim, torch.float32, seed=7)
    packed = (codecs.quantize_fp4_e4m3 if fmt == "e4m3" else codecs.quantize_fp4_e8m0)(x, block)
    ref = codecs.dequantize_fp4(packed, out_dtype)
    dev = codecs.PackedFP4(packed.codes.to(DEVICE), packed.scales.to(DEVICE), block, fmt)
    assert _same(tc.dequantize_fp4(dev, out_dtype), ref)
    g = torch.Generator().manual_seed(3)
    index = torch.randint(-1, ROWS, (17, 512), generator=g)
    gathered = tc.gather_dequantize_fp4(dev, index.to(DEVICE), out_dtype)
    assert gathered.shape == (17, 512, dim)
    assert _same(gathered, ref[index.clamp(min=0)])  # gather-then-dequantize, bit for bit


def test_engine_dispatch_uses_kernels_on_cuda_and_agrees() -> None:
    """codecs.* on a CUDA tensor dispatches to the kernels; the result equals the CPU codec."""
    if DEVICE != "cuda":
        pytest.skip("dispatch happens on CUDA tensors only")
    x = _inputs(512, torch.bfloat16, seed=11)
    got = codecs.quantize_fp4_e4m3(x.cuda())
    ref = codecs.quantize_fp4_e4m3(x)
    assert _same(got.codes, ref.codes) and _same(got.scales, ref.scales)
    assert _same(codecs.dequantize_fp4(got, torch.bfloat16), codecs.dequantize_fp4(ref, torch.bfloat16))
    idx = torch.randint(-1, ROWS, (3, 64))
    assert _same(codecs.gather_dequantize_fp4(got, idx.cuda(), torch.bfloat16),
                 codecs.gather_dequantize_fp4(ref, idx, torch.bfloat16))


def test_v3_blockwise_division_equals_div_rn_exhaustively() -> None:
    """v3 divides by one reciprocal per block plus an fma correction (Markstein) instead of a
    correctly rounded division per value: for every E4M3 scale and every bf16 value a block
    with that scale can hold, and for 16M random float32 values over 60 decades, its codes and
    scales equal v2's (`div_rn` per value) bit for bit; the E8M0 quantizers likewise on the same data. CUDA only: the interpreter is too slow
    for 20M values, and only the device's fma and division are the ones that matter."""
    if DEVICE != "cuda":
        pytest.skip("exhaustive sweep: CUDA only")
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every positive E4M3
    values = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()  # finite >= 0
    blocks = []
    for s in scales.tolist():
        top = 6.0 * s  # the block max whose scale is exactly s
        v = values[values <= top]
        v = torch.cat([v, -v])
        pad = (-v.numel()) % 15
        v = torch.cat([v, torch.zeros(pad)]).view(-1, 15)
        blocks.append(torch.cat([torch.full((v.shape[0], 1), top), v], dim=1))
    x = torch.cat(blocks)
    x = torch.cat([x, torch.zeros((-x.shape[0]) % 32, 16)]).reshape(-1, 512).to(torch.bfloat16).cuda()
    g = torch.Generator(device="cuda").manual_seed(5)
    y = torch.randn(1 << 15, 512, device="cuda", generator=g) * torch.exp2(
        torch.randint(-100, 100, (1 << 15, 1), device="cuda", generator=g).float())
    for inp in (x, y):
        for quant, block in ((tc.quantize_fp4_e4m3, 16), (tc.quantize_fp4_e8m0, 32)):
            results = {}
            for variant in ("v2", "v3", "v5", "v6"):
                saved = tc.set_config(variant, op="quantize")
                try:
                    results[variant] = quant(inp, block)
                finally:
                    tc.restore_config(saved)
            for v in ("v3", "v5", "v6"):
                assert _same(results[v].codes, results["v2"].codes), (v, block)
                assert _same(results[v].scales, results["v2"].scales), (v, block)
