"""Triton kernels for the FP4 codecs of codecs.py, bit-identical to the torch versions.

Why kernels: the torch codecs take ~10 elementwise passes (block amax, scale, divide, clamp,
floor + ceil, table lookup, pack), each a trip through HBM; one kernel reads the input once
and writes codes and scales once. On the H200 that is 24x (quantize) and 6-8x (dequantize)
faster than the torch codecs on CUDA. Against a device copy of the same bytes
(bench/results/gpu_report-cuda.json, 2026-11-29): dequantize 76% (v3: each packed byte read once),
quantize 54% (E4M3) and 68% (E8M0) with v5. Quantize is bound by the integer/logic pipe (Nsight
Compute on v4: ALU pipe 82% busy, occupancy 19% from registers): compares, selects and min/max,
not bytes. v3-v5 cut the per-value division to one per block plus an fma correction (E4M3) and
move the E2M1 encoder onto the FMA pipe; E4M3 is still short of 60% of copy.
Decode attention also needs
only the top-k selected entries: `gather_dequantize_fp4` reads those packed rows (288 B) and
writes bf16/fp32 rows, instead of keeping every entry dequantized and gathering from it.

Bit-exactness with codecs.py, step by step (ENGINE.md §3 formulas):
- amax: max |x| per block in float32; a NaN anywhere in a block makes its amax NaN (torch's
  amax propagates NaN; `tl.max` would drop it, so NaN is tracked separately).
- E4M3 scale: ``e4m3(max(amax, 6*2**-9) / 6)`` with a correctly rounded division
  (`div_rn`), clamped at 448, then rounded to E4M3 nearest-even on the float32 bits (the
  dropped-bit count is 20 for normals and grows below 2**-6, where E4M3 is subnormal).
  Same double rounding as torch's float32 divide then float8 cast.
- E8M0 scale: the biased exponent of ``max(amax, 6*2**-126) / 6``, plus one if any mantissa
  bit is set (codecs._e8m0_bytes).
- Codes: t = x / (s / 4) (correctly rounded, as torch divides), then the E2M1 code of t / 4
  from integer-valued thresholds on |t| (1, 3, 5, 7, 10, 14, 20: every rounding threshold of
  the grid times 4, ``>`` where the tie goes down to the even code, ``>=`` where it goes up),
  sign bit for t < 0; NaN gives code 0. Equal to the 97-entry table of codecs.py for every t.
- Decode: an E2M1 value (2 significant bits) times a scale (<= 4 significant bits) is exact
  in float32, then one rounding to the output dtype, as `dequantize_fp4` does.

Kernels run on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (tests here).
"""

from __future__ import annotations

import functools
import os

import torch

from .codecs import PackedFP4

try:  # triton is optional: CPU-only installs use the torch codecs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None

__all__ = ["available", "set_config", "restore_config", "quantize_fp4_e4m3", "quantize_fp4_e8m0", "dequantize_fp4", "gather_dequantize_fp4"]



@functools.lru_cache(maxsize=None)
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """True when the kernels can run on `device`: CUDA with triton, or any device when interpreting.

    ``STATESTORE_TRITON=0`` turns them off (the engine then uses the torch codecs).
    """
    if triton is None or os.environ.get("STATESTORE_TRITON", "1") == "0":
        return False
    return torch.device(device).type == "cuda" or _interpreting()


if triton is not None:

    @triton.jit
    def _e2m1_codes(t):
        """E2M1 codes of t / 4 for float32 t (4x the scaled value); NaN -> 0."""
        a = tl.abs(t)
        mag = ((a > 1.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a > 5.0).to(tl.int32)
               + (a >= 7.0).to(tl.int32) + (a > 10.0).to(tl.int32) + (a >= 14.0).to(tl.int32)
               + (a > 20.0).to(tl.int32))
        return mag | ((t < 0.0).to(tl.int32) << 3)

    @triton.jit
    def _e2m1_values(code):
        """int32 E2M1 codes 0..15 -> float32 values (code 8 is -0.0)."""
        m = code & 7
        mf = m.to(tl.float32)
        mag = tl.where(m < 4, mf * 0.5, tl.where(m < 6, mf - 2.0, tl.where(m == 6, 4.0, 6.0)))
        # the sign goes in by its bit: `-x` is `0 - x` in triton, which turns -0.0 (code 8) into +0.0
        return (mag.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _e4m3_round(v):
        """float32 v in [2**-9, 448] (or NaN) -> (E4M3 byte as int32, its value as float32)."""
        bits = v.to(tl.int32, bitcast=True)
        exp = (bits >> 23) & 0xFF
        drop = 20 + tl.maximum(121 - exp, 0)  # 121 = biased exponent of 2**-6, E4M3's smallest normal
        lsb = tl.where(drop >= 23, 1, (bits >> drop) & 1)  # at 2**-9 the kept bit is the implicit one
        rounded = (bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)
        value = rounded.to(tl.float32, bitcast=True)
        rexp = (rounded >> 23) & 0xFF
        normal = ((rexp - 120) << 3) | ((rounded >> 20) & 7)
        sub = (value * 512.0).to(tl.int32)
        code = tl.where(rexp >= 121, normal, sub)
        nan = v != v
        return tl.where(nan, 0x7F, code), tl.where(nan, v, value)

    @triton.jit
    def _e4m3_decode(b):
        """int32 E4M3 bytes -> float32 (0x7F / 0xFF are NaN)."""
        e = (b >> 3) & 15
        m = b & 7
        normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
        value = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        value = (value.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
        return tl.where((b & 0x7F) == 0x7F, float("nan"), value)

    @triton.jit
    def _e8m0_decode(b):
        """int32 biased E8M0 bytes -> float32 2**(b - 127); 255 is NaN, 0 is 2**-127 (subnormal)."""
        value = (b << 23).to(tl.float32, bitcast=True)
        value = tl.where(b == 0, 5.877471754111438e-39, value)
        return tl.where(b == 255, float("nan"), value)

    @triton.jit
    def _quantize_kernel(x_ptr, codes_ptr, scales_ptr, n_rows,
                         D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        """One program: ROWS rows of D values in blocks of BS -> packed codes and scale bytes."""
        NB: tl.constexpr = D // BS
        HB: tl.constexpr = BS // 2
        pid = tl.program_id(0)
        r = pid * ROWS + tl.arange(0, ROWS)
        b = tl.arange(0, NB)
        h = tl.arange(0, HB)
        p = tl.arange(0, 2)
        r4 = r[:, None, None, None]
        offs = r4.to(tl.int64) * D + b[None, :, None, None] * BS + h[None, None, :, None] * 2 + p[None, None, None, :]
        mask = r4 < n_rows
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(x), axis=3), axis=2)  # [ROWS, NB]
        has_nan = tl.max(tl.max((x != x).to(tl.int32), axis=3), axis=2) > 0
        if E4M3:
            v = tl.minimum(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0), 448.0)  # floor 6 * 2**-9
            v = tl.where(has_nan, float("nan"), v)
            byte, scale = _e4m3_round(v)
        else:
            v = tl.math.div_rn(tl.maximum(amax, 6.0 * 1.1754943508222875e-38), 6.0)  # floor 6 * 2**-126
            vb = v.to(tl.int32, bitcast=True)
            byte = ((vb >> 23) & 0xFF) + ((vb & 0x7FFFFF) != 0).to(tl.int32)
            byte = tl.where(has_nan, 255, tl.minimum(byte, 255))
            scale = _e8m0_decode(byte)
        quarter = (scale * 0.25)[:, :, None, None]
        codes = _e2m1_codes(tl.math.div_rn(x, quarter))
        lo, hi = tl.split(codes)  # [ROWS, NB, HB]: elements 2i and 2i + 1
        packed = (lo | (hi << 4)).to(tl.uint8)
        r3 = r[:, None, None]
        c_offs = r3.to(tl.int64) * (D // 2) + b[None, :, None] * HB + h[None, None, :]
        tl.store(codes_ptr + c_offs, packed, mask=r3 < n_rows)
        r2 = r[:, None]
        tl.store(scales_ptr + r2.to(tl.int64) * NB + b[None, :], byte.to(tl.uint8), mask=r2 < n_rows)

    @triton.jit
    def _dequant_rows(codes_ptr, scales_ptr, out_ptr, src_rows, dst_rows, valid,
                      D: tl.constexpr, BS: tl.constexpr, E4M3: tl.constexpr):
        """Decode packed rows `src_rows` into output rows `dst_rows` (both [ROWS] int64)."""
        NB: tl.constexpr = D // BS
        HB: tl.constexpr = BS // 2
        b = tl.arange(0, NB)
        h = tl.arange(0, HB)
        p = tl.arange(0, 2)
        s3 = src_rows[:, None, None]
        v3 = valid[:, None, None]
        c = tl.load(codes_ptr + s3 * (D // 2) + b[None, :, None] * HB + h[None, None, :], mask=v3, other=0)
        c = c.to(tl.int32)
        scale = _load_scales(scales_ptr, src_rows, valid, NB, E4M3)
        scale3 = scale[:, :, None]
        lo = _e2m1_values(c & 15) * scale3
        hi = _e2m1_values(c >> 4) * scale3
        vals = tl.join(lo, hi)  # [ROWS, NB, HB, 2]
        d4 = dst_rows[:, None, None, None]
        offs = d4 * D + b[None, :, None, None] * BS + h[None, None, :, None] * 2 + p[None, None, None, :]
        tl.store(out_ptr + offs, vals.to(out_ptr.dtype.element_ty), mask=valid[:, None, None, None])

    @triton.jit
    def _dequantize_kernel(codes_ptr, scales_ptr, out_ptr, n_rows,
                           D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rows = r.to(tl.int64)
        _dequant_rows(codes_ptr, scales_ptr, out_ptr, rows, rows, r < n_rows, D, BS, E4M3)

    @triton.jit
    def _gather_dequantize_kernel(idx_ptr, codes_ptr, scales_ptr, out_ptr, n_out,
                                  D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        """Output row i = dequantized entry idx[i] (idx < 0 reads entry 0, as the engine's clamp does)."""
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        valid = r < n_out
        src = tl.load(idx_ptr + r, mask=valid, other=0).to(tl.int64)
        src = tl.maximum(src, 0)
        _dequant_rows(codes_ptr, scales_ptr, out_ptr, src, r.to(tl.int64), valid, D, BS, E4M3)


    @triton.jit
    def _max_nan(a, b):
        """max that propagates NaN, as torch's amax does."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _scale_e4m3(amax):
        """Block max (NaN if the block holds one) -> (E4M3 scale byte, scale value)."""
        v = tl.minimum(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0), 448.0)  # floor 6 * 2**-9
        return _e4m3_round(tl.where(amax != amax, amax, v))

    @triton.jit
    def _scale_e8m0(amax):
        """Block max (NaN if the block holds one) -> E8M0 scale byte (255 for NaN and inf)."""
        v = tl.math.div_rn(tl.maximum(amax, 6.0 * 1.1754943508222875e-38), 6.0)  # floor 6 * 2**-126
        vb = v.to(tl.int32, bitcast=True)
        byte = ((vb >> 23) & 0xFF) + ((vb & 0x7FFFFF) != 0).to(tl.int32)
        return tl.where(amax != amax, 255, tl.minimum(byte, 255))

    @triton.jit
    def _load_scales(scales_ptr, src_rows, valid, NB: tl.constexpr, E4M3: tl.constexpr):
        """[ROWS, NB] float32 scales of packed rows `src_rows` (masked by `valid`)."""
        sb = tl.load(scales_ptr + src_rows[:, None] * NB + tl.arange(0, NB)[None, :], mask=valid[:, None],
                     other=0).to(tl.int32)
        if E4M3:
            scale = _e4m3_decode(sb)
        else:
            scale = _e8m0_decode(sb)
        return scale

    @triton.jit
    def _e2m1_codes_v2(t):
        """`_e2m1_codes` with 3 roundings instead of 7 threshold tests: on the grid in quarters
        (0, 2, 4, 6 | 8, 12 | 16, 24) the index is rint(a/2) below 8, 4 + rint((a-8)/4) below 16,
        6 + rint((a-16)/8) above (rint = nearest-even, which resolves every tie as the table does:
        a = 1, 5 -> down to even; 3, 7 -> up to even; 10 -> 4, 14 -> 6, 20 -> 6)."""
        a = tl.minimum(tl.abs(t), 24.0)
        # (y + 2**23) - 2**23 rounds y in [0, 2**22) to an integer, ties to even (float32 adds)
        lo = (a * 0.5 + 8388608.0) - 8388608.0
        mid = 4.0 + ((tl.maximum(a - 8.0, 0.0) * 0.25 + 8388608.0) - 8388608.0)
        hi = 6.0 + ((tl.maximum(a - 16.0, 0.0) * 0.125 + 8388608.0) - 8388608.0)
        mag = tl.where(a < 8.0, lo, tl.where(a < 16.0, mid, hi)).to(tl.int32)
        mag = tl.where(t == t, mag, 0)  # NaN -> 0 (tl.minimum above may have turned NaN into 24)
        return mag | ((t < 0.0).to(tl.int32) << 3)

    @triton.jit
    def _div_pow2(xb, byte):
        """x / (s / 4) for x and E8M0 scale bytes shaped to broadcast against it (one per block,
        e.g. [R, NB, 1] for [R, NB, BS] x), by multiplying with the exact reciprocal.

        s / 4 = 2**(byte - 129) is a power of two, so x * 2**(129 - byte) is the same real number
        as the quotient and rounds to the same float (overflow, subnormals, signed zeros, NaN
        and inf included): bit-identical to `div_rn`. byte = 1 (s = 2**-126, the floor) would
        need 2**128, which float32 lacks: there x * 2 (exact: |x| <= 6 * 2**-126 in that block)
        then * 2**127. byte = 255 (a NaN or inf in the block) -> NaN, as x / NaN is.
        """
        recip = ((256 - byte) << 23).to(tl.float32, bitcast=True)  # 2**(129 - byte), 2 <= byte <= 254
        recip = tl.where(byte == 1, 1.7014118346046923e38, recip)  # 2**127
        recip = tl.where(byte == 255, float("nan"), recip)
        pre = tl.where(byte == 1, 2.0, 1.0)
        return (xb * pre) * recip

    @triton.jit
    def _quantize_v2_kernel(x_ptr, codes_ptr, scales_ptr, n_rows,
                            D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        """2-D tiles: one contiguous [ROWS, D] load, NaN-propagating block max, cheaper encode."""
        NB: tl.constexpr = D // BS
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, D)
        mask = r[:, None] < n_rows
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xb = tl.reshape(x, [ROWS, NB, BS])
        amax = tl.reduce(tl.abs(xb), 2, _max_nan)  # [ROWS, NB]; NaN if the block holds one
        if E4M3:
            byte, scale = _scale_e4m3(amax)
            t = tl.math.div_rn(xb, (scale * 0.25)[:, :, None])
        else:
            byte = _scale_e8m0(amax)
            t = _div_pow2(xb, byte[:, :, None])
        codes = _e2m1_codes_v2(t)
        lo, hi = tl.split(tl.reshape(codes, [ROWS, D // 2, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        hcols = tl.arange(0, D // 2)
        tl.store(codes_ptr + r[:, None].to(tl.int64) * (D // 2) + hcols[None, :], packed, mask=mask)
        tl.store(scales_ptr + r[:, None].to(tl.int64) * NB + tl.arange(0, NB)[None, :], byte.to(tl.uint8), mask=mask)

    @triton.jit
    def _dequant_rows_v2(codes_ptr, scales_ptr, out_ptr, src_rows, dst_rows, valid,
                         D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        """2-D output tiles [ROWS, D], stored contiguously; each output element reads its byte."""
        NB: tl.constexpr = D // BS
        cols = tl.arange(0, D)
        m2 = valid[:, None]
        byte = tl.load(codes_ptr + src_rows[:, None] * (D // 2) + (cols // 2)[None, :], mask=m2, other=0).to(tl.int32)
        code = (byte >> ((cols & 1) * 4)[None, :]) & 15
        scale = _load_scales(scales_ptr, src_rows, valid, NB, E4M3)
        vals = tl.reshape(tl.reshape(_e2m1_values(code), [ROWS, NB, BS]) * scale[:, :, None], [ROWS, D])
        tl.store(out_ptr + dst_rows[:, None] * D + cols[None, :], vals.to(out_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _dequantize_rows_kernel(codes_ptr, scales_ptr, out_ptr, n_rows, D: tl.constexpr, BS: tl.constexpr,
                                ROWS: tl.constexpr, E4M3: tl.constexpr, DECODE_ROWS: tl.constexpr):
        """Rows [ROWS * pid, ...) decoded in place by DECODE_ROWS (`_dequant_rows_v2` / `_v3`)."""
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rows = r.to(tl.int64)
        DECODE_ROWS(codes_ptr, scales_ptr, out_ptr, rows, rows, r < n_rows, D, BS, ROWS, E4M3)

    @triton.jit
    def _gather_dequantize_rows_kernel(idx_ptr, codes_ptr, scales_ptr, out_ptr, n_out, D: tl.constexpr,
                                       BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr,
                                       DECODE_ROWS: tl.constexpr):
        """Output rows [ROWS * pid, ...) decoded by DECODE_ROWS from the entries idx names (-1: 0)."""
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        valid = r < n_out
        src = tl.maximum(tl.load(idx_ptr + r, mask=valid, other=0).to(tl.int64), 0)
        DECODE_ROWS(codes_ptr, scales_ptr, out_ptr, src, r.to(tl.int64), valid, D, BS, ROWS, E4M3)

    @triton.jit
    def _div_rn_by_block(xb, q):
        """RN(x / q) for x and q shaped to broadcast against it (one per block, e.g. [R, NB, 1]
        for [R, NB, BS] x) with one division per block, not per value.

        Markstein's correction: with r = RN(1/q) (the one `div_rn` per block), t1 = RN(x * r)
        is within one ulp of x / q, the remainder x - q * t1 is exact in an fma, and
        RN(t1 + rem * r) is the correctly rounded quotient, bit-identical to `div_rn(x, q)`.
        It needs t1 finite and x - q * t1 free of overflow: where |t1| >= 32 (inf, or a value the
        E2M1 encoder clamps to its top code anyway, and where t1 and the quotient give the same
        code) t1 itself is used. NaN in x or q stays NaN. -0.0 may come back as +0.0, which
        `_e2m1_codes_v2` encodes alike (its sign bit is `t < 0`).
        """
        r = tl.math.div_rn(tl.full(q.shape, 1.0, tl.float32), q)
        t1 = xb * r
        rem = tl.fma(t1, -q, xb)
        t2 = tl.fma(rem, r, t1)
        return tl.where(tl.abs(t1) < 32.0, t2, t1)

    @triton.jit
    def _quantize_v3_kernel(x_ptr, codes_ptr, scales_ptr, n_rows,
                            D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        """v2 with the E4M3 per-value division replaced by `_div_rn_by_block` (the per-value
        `div_rn` made E4M3 quantize arithmetic-bound at 41% of copy bandwidth)."""
        NB: tl.constexpr = D // BS
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, D)
        mask = r[:, None] < n_rows
        x = tl.load(x_ptr + r[:, None].to(tl.int64) * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xb = tl.reshape(x, [ROWS, NB, BS])
        amax = tl.reduce(tl.abs(xb), 2, _max_nan)
        if E4M3:
            byte, scale = _scale_e4m3(amax)
            t = _div_rn_by_block(xb, (scale * 0.25)[:, :, None])
        else:
            byte = _scale_e8m0(amax)
            t = _div_pow2(xb, byte[:, :, None])
        codes = _e2m1_codes_v2(t)
        lo, hi = tl.split(tl.reshape(codes, [ROWS, D // 2, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        hcols = tl.arange(0, D // 2)
        tl.store(codes_ptr + r[:, None].to(tl.int64) * (D // 2) + hcols[None, :], packed, mask=mask)
        tl.store(scales_ptr + r[:, None].to(tl.int64) * NB + tl.arange(0, NB)[None, :], byte.to(tl.uint8), mask=mask)

    @triton.jit
    def _dequant_rows_v3(codes_ptr, scales_ptr, out_ptr, src_rows, dst_rows, valid,
                         D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        """Each packed byte read once and decoded into its two values, joined pairwise
        (v2 reads every byte twice, once per output element, and shifts per element)."""
        NB: tl.constexpr = D // BS
        H: tl.constexpr = D // 2
        m2 = valid[:, None]
        c = tl.load(codes_ptr + src_rows[:, None] * H + tl.arange(0, H)[None, :], mask=m2, other=0).to(tl.int32)
        scale = _load_scales(scales_ptr, src_rows, valid, NB, E4M3)
        per_byte = tl.reshape(tl.broadcast_to(scale[:, :, None], [ROWS, NB, BS // 2]), [ROWS, H])
        lo = _e2m1_values(c & 15) * per_byte
        hi = _e2m1_values(c >> 4) * per_byte
        vals = tl.reshape(tl.join(lo, hi), [ROWS, D])
        tl.store(out_ptr + dst_rows[:, None] * D + tl.arange(0, D)[None, :], vals.to(out_ptr.dtype.element_ty), mask=m2)

    @triton.jit
    def _e2m1_codes_v5(t):
        """E2M1 code of t / 4 (NaN not handled: the caller zeroes NaN blocks) with most work on
        the FMA pipe: a select-based encoder (v4, removed) loaded the integer/logic pipe that bounds
        quantize (Nsight: ALU 82% busy).

        The code of a = |t| (quarters of the grid) is rint(min(a/2, 2 + a/4, 4 + a/8)) clamped at
        7: the grid is concave piecewise linear in the code, and rint is monotone, so it is also
        the min of the three rounded lines. Each line is rounded exactly by one fma against
        2**23 + offset (a * s is exact; ties to even as the table: 1 -> 0, 3 -> 2, 5 -> 2, 7 -> 4,
        10 -> 4, 14 -> 6, 20 -> 6), the min of those floats is taken with 2**23 + 7 (inf -> 7), and
        the code is the low 3 bits. The sign bit is that of t + 0.0, which is +0.0 for -0.0: set
        exactly when t < 0.
        """
        a = tl.abs(t)
        m = tl.minimum(tl.minimum(tl.fma(a, 0.5, 8388608.0), tl.fma(a, 0.25, 8388610.0)),
                       tl.minimum(tl.fma(a, 0.125, 8388612.0), 8388615.0))
        sign = ((t + 0.0).to(tl.int32, bitcast=True) >> 28) & 8
        return (m.to(tl.int32, bitcast=True) & 7) | sign

    @triton.jit
    def _quantize_v5_kernel(x_ptr, codes_ptr, scales_ptr, n_rows,
                            D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        """One scale block per tile row: the input seen as [n_rows * D / BS, BS] (blocks are
        contiguous), a program takes ROWS * D / BS of them. The block max is a plain row
        reduction and the scale math runs once per block; the [ROWS, NB, BS] reshape of v2/v3
        made the compiler replicate the per-block scale math across a thread's values."""
        NB: tl.constexpr = D // BS
        NBLK: tl.constexpr = ROWS * NB
        blk = tl.program_id(0).to(tl.int64) * NBLK + tl.arange(0, NBLK)
        valid = (blk // NB) < n_rows  # (n_rows may arrive as a constant: triton specialises 1)
        cols = tl.arange(0, BS)
        x = tl.load(x_ptr + blk[:, None] * BS + cols[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 1, _max_nan)  # [NBLK]
        if E4M3:
            byte, scale = _scale_e4m3(amax)
            t = _div_rn_by_block(x, (scale * 0.25)[:, None])
        else:
            byte = _scale_e8m0(amax)
            t = _div_pow2(x, byte[:, None])
        codes = _e2m1_codes_v5(t)
        lo, hi = tl.split(tl.reshape(codes, [NBLK, BS // 2, 2]))
        # the blocks whose every t is NaN get code 0 here, once per byte: a NaN in the block (both
        # formats) or an inf (E8M0: scale byte 255, which decodes to NaN)
        nan_block = (amax != amax) if E4M3 else (byte == 255)
        packed = tl.where(nan_block[:, None], 0, lo + hi * 16).to(tl.uint8)
        tl.store(codes_ptr + blk[:, None] * (BS // 2) + tl.arange(0, BS // 2)[None, :], packed, mask=valid[:, None])
        tl.store(scales_ptr + blk, byte.to(tl.uint8), mask=valid)


    @triton.jit
    def _quantize_v6_kernel(x_ptr, codes_ptr, scales_ptr, n_rows,
                            D: tl.constexpr, BS: tl.constexpr, ROWS: tl.constexpr, E4M3: tl.constexpr):
        """v5 with each scale block loaded as its two halves, two [blocks, BS/2] loads of one
        layout joined into [blocks, BS/2, 2]: a thread holds whole blocks (for BS = 16 bf16, two
        16-byte loads), so the block max needs no shuffle and the per-block scale math runs once
        per block. v5's [blocks, BS] tile spread a block over two threads, which both ran it."""
        NB: tl.constexpr = D // BS
        NBLK: tl.constexpr = ROWS * NB
        H: tl.constexpr = BS // 2
        blk = tl.program_id(0).to(tl.int64) * NBLK + tl.arange(0, NBLK)
        valid = (blk // NB) < n_rows
        src = x_ptr + blk[:, None] * BS + tl.arange(0, H)[None, :]
        x = tl.join(tl.load(src, mask=valid[:, None], other=0.0),
                    tl.load(src + H, mask=valid[:, None], other=0.0)).to(tl.float32)  # [NBLK, H, 2]
        amax = tl.reduce(tl.reduce(tl.abs(x), 2, _max_nan), 1, _max_nan)  # [NBLK]
        if E4M3:
            byte, scale = _scale_e4m3(amax)
            t = _div_rn_by_block(x, (scale * 0.25)[:, None, None])
        else:
            byte = _scale_e8m0(amax)
            t = _div_pow2(x, byte[:, None, None])
        first, second = tl.split(_e2m1_codes_v5(t))  # the block's values 0..H-1 and H..BS-1
        nan_block = (amax != amax) if E4M3 else (byte == 255)
        dst = codes_ptr + blk[:, None] * (BS // 2) + tl.arange(0, H // 2)[None, :]
        lo, hi = tl.split(tl.reshape(first, [NBLK, H // 2, 2]))
        tl.store(dst, tl.where(nan_block[:, None], 0, lo + hi * 16).to(tl.uint8), mask=valid[:, None])
        lo, hi = tl.split(tl.reshape(second, [NBLK, H // 2, 2]))
        tl.store(dst + H // 2, tl.where(nan_block[:, None], 0, lo + hi * 16).to(tl.uint8), mask=valid[:, None])
        tl.store(scales_ptr + blk, byte.to(tl.uint8), mask=valid)

    # the row decoder of each variant's dequantize and gather kernels (v5 and v6 change only the
    # quantizer: their decoders are v3's)
    _DECODE_ROWS = {"v2": _dequant_rows_v2, "v3": _dequant_rows_v3, "v5": _dequant_rows_v3, "v6": _dequant_rows_v3}

# ---------------------------------------------------------------------------------------------
# Wrappers: same signatures and results as the codecs.py functions of the same names.


# Kernel variant and launch shape per op: "v1" (4-D tiles), "v2" (2-D tiles, cheaper encode),
# "v3" (v2 + one division per block for E4M3; decoders read each packed byte once), "v5" (quantize
# over [blocks, BS] tiles with the FMA-pipe encoder `_e2m1_codes_v5`; v3's decoders), "v6" (v5 with
# a thread holding whole blocks: the per-block scale math once per block, not once per thread of
# it), values per program and warps. bench.gpu_report sweeps them on the H200 (`set_config`); every
# variant gives the same bits (tests/gpu runs all of them, and v3, v5 and v6 against v2
# exhaustively over bf16 inputs). Defaults: near the sweep's winners on the H200, 2026-11-30
# (bench/results/gpu_report-cuda.json): v6 quantize at 2,048 values / 2 warps (main 1.22 ms with v5
# -> 0.96 ms, index 0.96 -> 0.86 ms), v3 dequantize and gather at 2,048 / 2 (main dequantize
# 1.03 -> 0.85 ms against v2).
_OPS = ("quantize", "dequantize", "gather_dequantize")
_CONFIG = {"quantize": {"variant": "v6", "elems": 2048, "num_warps": 2},
           "dequantize": {"variant": "v3", "elems": 2048, "num_warps": 2},
           "gather_dequantize": {"variant": "v3", "elems": 2048, "num_warps": 2}}
VARIANTS = ("v1", "v2", "v3", "v5", "v6")  # v4 (v5 with a select-based encoder) lost to v5 on every op


def set_config(variant: str | None = None, elems: int | None = None, num_warps: int | None = None, *,
               op: str | None = None) -> dict:
    """Choose the kernel variant and launch shape of one op (default: every op); returns the old config."""
    old = {k: dict(v) for k, v in _CONFIG.items()}
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    for name in _OPS if op is None else (op,):
        cfg = _CONFIG[name]
        for key, value in (("variant", variant), ("elems", elems), ("num_warps", num_warps)):
            if value is not None:
                cfg[key] = value
    return old


def restore_config(saved: dict) -> None:
    for name, cfg in saved.items():
        _CONFIG[name].update(cfg)


def _launch(op: str, dim: int):
    """(kernel, rows per program, warps, extra constexpr arguments) for `op` at row width `dim`."""
    cfg = _CONFIG[op]
    variant, extra = cfg["variant"], {}
    if variant == "v1":
        kernel = globals()[f"_{op}_kernel"]
    elif op == "quantize":
        kernel = globals()[f"_{op}_{variant}_kernel"]
    else:  # the decoders share their kernels; a variant is its row decoder
        kernel, extra = globals()[f"_{op}_rows_kernel"], {"DECODE_ROWS": _DECODE_ROWS[variant]}
    return kernel, max(1, cfg["elems"] // dim), cfg["num_warps"], extra


def _check(x: torch.Tensor, block: int, fn: str) -> None:
    if triton is None:
        raise RuntimeError(f"{fn}: triton is not installed; use engine_adapter.ced.codecs")
    if not x.is_floating_point() or x.dim() == 0:
        raise ValueError(f"{fn}: expected a floating tensor with at least 1 dim, got {x.dtype} {tuple(x.shape)}")
    d = x.shape[-1]
    if d % block or d % 2 or block % 2 or (d // block) & (d // block - 1) or block & (block - 1):
        raise ValueError(f"{fn}: last dim {d} must be a power-of-two number of power-of-two blocks of {block}")


def _quantize(x: torch.Tensor, block: int, e4m3: bool, fn: str) -> PackedFP4:
    _check(x, block, fn)
    d = x.shape[-1]
    flat = x.reshape(-1, d).contiguous()
    n = flat.shape[0]
    codes = torch.empty(n, d // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n, d // block, dtype=torch.uint8, device=x.device)
    if n:
        kernel, rows, warps, extra = _launch("quantize", d)
        kernel[(triton.cdiv(n, rows),)](flat, codes, scales, n, D=d, BS=block, ROWS=rows, E4M3=e4m3, num_warps=warps,
                                        **extra)
    lead = x.shape[:-1]
    return PackedFP4(codes=codes.view(*lead, d // 2), scales=scales.view(*lead, d // block), block=block,
                     scale_format="e4m3" if e4m3 else "e8m0")


def quantize_fp4_e4m3(x: torch.Tensor, block: int = 16) -> PackedFP4:
    """Main global KV: E2M1 + one E4M3 scale per `block` (bit-identical to codecs.quantize_fp4_e4m3)."""
    return _quantize(x, block, True, "quantize_fp4_e4m3")


def quantize_fp4_e8m0(x: torch.Tensor, block: int = 32) -> PackedFP4:
    """Index keys: E2M1 + one E8M0 scale per `block` (bit-identical to codecs.quantize_fp4_e8m0)."""
    return _quantize(x, block, False, "quantize_fp4_e8m0")


def _check_packed(p: PackedFP4, fn: str) -> tuple[int, int]:
    if triton is None:
        raise RuntimeError(f"{fn}: triton is not installed; use engine_adapter.ced.codecs")
    d, nb = p.dim, p.scales.shape[-1]
    if nb & (nb - 1) or p.block & (p.block - 1):
        raise ValueError(f"{fn}: {nb} blocks of {p.block} values: both must be powers of two")
    return d, nb


def dequantize_fp4(p: PackedFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PackedFP4 -> [..., d] values of `dtype` (bit-identical to codecs.dequantize_fp4)."""
    d, nb = _check_packed(p, "dequantize_fp4")
    codes = p.codes.reshape(-1, d // 2).contiguous()
    scales = p.scales.reshape(-1, nb).contiguous()
    n = codes.shape[0]
    out = torch.empty(n, d, dtype=dtype, device=codes.device)
    if n:
        kernel, rows, warps, extra = _launch("dequantize", d)
        kernel[(triton.cdiv(n, rows),)](codes, scales, out, n, D=d, BS=p.block, ROWS=rows,
                                        E4M3=p.scale_format == "e4m3", num_warps=warps, **extra)
    return out.view(*p.codes.shape[:-1], d)


def gather_dequantize_fp4(p: PackedFP4, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `index` (any shape, int; -1 reads row 0) of [E, d/2] packed entries -> [*index.shape, d].

    Equal, bit for bit, to ``dequantize_fp4(p, dtype)[index.clamp(min=0)]``, reading only the
    selected packed rows.
    """
    d, nb = _check_packed(p, "gather_dequantize_fp4")
    if p.codes.dim() != 2:
        raise ValueError(f"gather_dequantize_fp4: entries must be [E, d/2], got {tuple(p.codes.shape)}")
    if p.codes.shape[0] == 0:
        raise ValueError("gather_dequantize_fp4: no entries to gather from")
    idx = index.reshape(-1).contiguous()
    n = idx.shape[0]
    out = torch.empty(n, d, dtype=dtype, device=p.codes.device)
    if n:
        kernel, rows, warps, extra = _launch("gather_dequantize", d)
        kernel[(triton.cdiv(n, rows),)](idx, p.codes.contiguous(), p.scales.contiguous(), out, n, D=d, BS=p.block,
                                        ROWS=rows, E4M3=p.scale_format == "e4m3", num_warps=warps, **extra)
    return out.view(*index.shape, d)
