"""Block-scaled FP4 (E2M1) and FP8 (E4M3) codecs for the CED engine's state (ENGINE.md §3).

Pure torch; every function works on CPU and CUDA tensors of any leading shape and quantizes
along the last dimension. The byte layouts here *are* the persisted format, so they must be
bit-identical across devices and torch builds:

    main global KV  E2M1 codes (2 per byte) + one E4M3 scale per 16   512-d -> 256 + 32 = 288 B
    index keys      E2M1 codes (2 per byte) + one E8M0 scale per 32   128-d ->  64 +  4 =  68 B
    SWA ring rows   E4M3 values (1 per byte) + one E8M0 scale per 32  512-d -> 512 + 16 = 528 B

    one stored FP4 row:  | c1c0 | c3c2 | ... | c(d-1)c(d-2) | s0 | s1 | ... | s(d/block-1) |
                           ^ element 2i in the LOW nibble       ^ raw scale bytes

Why no float4 dtype: torch 2.13's ``float4_e2m1fn_x2`` is storage-only (no casts, no gather or
index_put), so packed FP4 stays ``uint8`` and decodes through a lookup table. ``float8_e4m3fn``
casts work but arithmetic does not, so FP8 is upcast before any math and values are clamped
into range *before* the cast (the CPU saturates, other builds give NaN).

Quantization runs in float32 whatever the input dtype. Dequantization multiplies an E2M1 value
(2 significant bits) by a scale (at most 4 significant bits), which is exact in float32, so the
result does not depend on the device or the kernel.

Non-finite input: a NaN makes its block's scale NaN (E4M3 0x7F, E8M0 0xFF), so it stays visible
after dequantization; its codes are defined (0) so no lookup can go out of range. +-inf in an
E4M3 block saturates the scale at 448 and the codes at +-6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_AMAX_FLOOR",
    "E8M0_AMAX_FLOOR",
    "FP8_E8M0_AMAX_FLOOR",
    "SCALE_FORMATS",
    "PackedFP4",
    "PackedFP8",
    "e2m1_encode",
    "e2m1_decode",
    "pack_e2m1",
    "unpack_e2m1",
    "e4m3_block_scales",
    "e8m0_block_scales",
    "e8m0_decode",
    "quantize_fp4_e4m3",
    "quantize_fp4_e8m0",
    "dequantize_fp4",
    "gather_dequantize_fp4",
    "quantize_fp8_e8m0",
    "dequantize_fp8",
    "fp4_row_bytes",
    "fp8_row_bytes",
    "to_bytes",
    "fp4_from_bytes",
    "fp8_from_bytes",
]

_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Code c -> sign bit 3, magnitude index c & 7. Code 8 is -0.0 (equal to 0, as E2M1 defines it).
E2M1_VALUES: tuple[float, ...] = _E2M1_MAGNITUDES + tuple(-v for v in _E2M1_MAGNITUDES)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Floors on a block's amax so that an all-zero block still gets a finite, non-zero scale:
# 6 * 2**-9 / 6 = 2**-9 is the smallest E4M3 subnormal, 6 * 2**-126 / 6 = 2**-126 the smallest
# normal float32 (E8M0 byte 1). Both divisions by 6 (and by 448) are exact in float32.
E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
E8M0_AMAX_FLOOR = 6.0 * 2.0**-126
FP8_E8M0_AMAX_FLOOR = E4M3_MAX * 2.0**-126
SCALE_FORMATS = ("e4m3", "e8m0")

_E8M0_BIAS = 127
_E8M0_NAN = 255


# ---------------------------------------------------------------------------------------------
# Lookup tables: built once per (device, dtype) and never handed out, so nobody can mutate them.


@lru_cache(maxsize=None)
def _e2m1_lut(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[16] code -> value."""
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


@lru_cache(maxsize=None)
def _e2m1_pair_lut(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: packed byte b -> (value of low nibble, value of high nibble).

    Decoding a byte straight to its two values skips the unpack step on the hot path.
    """
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    pairs = torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1)
    return pairs.to(device)


def _nearest_even_index(a: float) -> int:
    """Grid index nearest to magnitude ``a``; a tie goes to the even index (mantissa bit 0)."""
    dists = [abs(a - g) for g in _E2M1_MAGNITUDES]
    best = min(dists)
    ties = [i for i, d in enumerate(dists) if d == best]
    return next((i for i in ties if i % 2 == 0), ties[0])


@lru_cache(maxsize=None)
def _e2m1_encode_lut(device: torch.device) -> torch.Tensor:
    """[97] uint8: ``floor(4y) + ceil(4y) + 48`` -> E2M1 code of y, for y in [-6, 6].

    Every rounding threshold of the grid (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is a multiple of
    1/4. So t = 4y is either an integer k (floor + ceil = 2k: y may sit exactly on a threshold,
    where the tie rule decides) or lies strictly inside (k, k + 1) (floor + ceil = 2k + 1: no
    threshold inside, every y there has the same nearest grid point). The table resolves
    both cases once, exactly, including ties to even; negative y keep their sign bit, -0.0 -> 0.
    """
    codes = []
    for m in range(97):
        half_t = (m - 48) / 2  # k for an exact point, k + 1/2 for an open interval
        sign = 8 if half_t < 0 else 0
        codes.append(sign | _nearest_even_index(abs(half_t) / 4))
    return torch.tensor(codes, dtype=torch.uint8, device=device)


@lru_cache(maxsize=None)
def _e8m0_lut(device: torch.device) -> torch.Tensor:
    """[256] float32: E8M0 byte -> 2**(byte - 127); 255 is NaN (OCP MX)."""
    values = [math.ldexp(1.0, b - _E8M0_BIAS) for b in range(255)] + [math.nan]
    return torch.tensor(values, dtype=torch.float32, device=device)


def _lookup(lut: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``lut[index]`` with the shape of ``index`` (plus lut's trailing dims).

    index_select with int32 indices is ~2.5x faster on the CPU than take or advanced indexing,
    which need int64 indices (measured on [4096, 512], torch 2.13).
    """
    flat = lut.index_select(0, index.int().reshape(-1))
    return flat.view(*index.shape, *lut.shape[1:])


# ---------------------------------------------------------------------------------------------
# Validation


def _check_block(block: int, fn: str) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"{fn}: block must be a positive int, got {block!r}")


def _check_float_rows(x: torch.Tensor, block: int, fn: str, *, paired: bool) -> None:
    """A floating tensor whose last dim splits into whole blocks (and whole bytes for FP4)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{fn}: expected a floating tensor, got dtype {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{fn}: expected at least 1 dim (quantizes along the last), got a 0-dim tensor")
    _check_block(block, fn)
    dim = x.shape[-1]
    if dim == 0 or dim % block:
        raise ValueError(f"{fn}: last dim {dim} must be a positive multiple of block={block}")
    if paired and dim % 2:
        raise ValueError(f"{fn}: last dim {dim} must be even (two E2M1 codes per byte)")


def _check_uint8(t: torch.Tensor, what: str, fn: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {what} must be a uint8 tensor, got {got}")
    if t.dim() == 0:
        raise ValueError(f"{fn}: {what} must have at least 1 dim, got a 0-dim tensor")


# ---------------------------------------------------------------------------------------------
# E2M1 codes and nibble packing


def _encode_quarters(t: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of y = t / 4, where t is float32 already clamped to [-24, 24] (a fresh tensor)."""
    m = torch.floor(t).add_(torch.ceil(t)).add_(48.0)
    # NaN would index outside the table (on CUDA: a device-side assert); map it to code 0.
    return _lookup(_e2m1_encode_lut(t.device), torch.nan_to_num_(m, nan=48.0))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Scaled values -> uint8 E2M1 codes 0..15 (same shape).

    Clamps to [-6, 6], then rounds to the nearest grid point, ties to the even code
    (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Computed in float32.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"e2m1_encode: expected a floating tensor, got {got}")
    t = x.float() * 4.0  # exact: a power-of-two multiply moves no threshold
    return _encode_quarters(t.clamp_(-4 * E2M1_MAX, 4 * E2M1_MAX))


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) -> values of ``dtype`` through a 16-entry table (same shape)."""
    _check_uint8(codes, "codes", "e2m1_decode")
    return _lookup(_e2m1_lut(codes.device, dtype), codes)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] uint8 codes (each 0..15) -> [..., n] bytes; element 2i goes in the LOW nibble.

    Codes above 15 are a caller bug and would spill into the neighbour's nibble; they are not
    checked here because that would need a device sync on the hot path.
    """
    _check_uint8(codes, "codes", "pack_e2m1")
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim {codes.shape[-1]} must be even (two codes per byte)")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] uint8 codes; inverse of :func:`pack_e2m1`."""
    _check_uint8(packed, "packed", "unpack_e2m1")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Block scales


def _block_amax(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as float32 [..., nb, block], per-block max |x| [..., nb])."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    return blocks, blocks.abs().amax(dim=-1)


def _e4m3_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-block amax -> float8_e4m3fn scales, ``e4m3(max(amax, 6*2**-9) / 6)`` saturated at 448."""
    s = amax.clamp(min=E4M3_AMAX_FLOOR).div_(E2M1_MAX).clamp_(max=E4M3_MAX)
    return s.to(torch.float8_e4m3fn)


def _e8m0_bytes(amax: torch.Tensor, amax_floor: float, qmax: float) -> torch.Tensor:
    """Per-block amax -> biased E8M0 byte of ``2**ceil(log2(max(amax, floor) / qmax))``.

    Read off the float32 bits rather than through log2, whose rounding can lose the ceiling for
    values just above a power of two: for a normal float, ceil(log2 v) + 127 is the biased
    exponent, plus one when any mantissa bit is set. The floor keeps v normal (>= 2**-126).
    A non-finite amax gives 255 (E8M0 NaN).
    """
    v = amax.clamp(min=amax_floor).div_(qmax)
    bits = v.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    biased += (bits & 0x7FFFFF) != 0
    return biased.clamp_(max=_E8M0_NAN).to(torch.uint8)


def e8m0_decode(scale_bytes: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 bytes -> float32 scales 2**(byte - 127) (255 -> NaN)."""
    _check_uint8(scale_bytes, "scale_bytes", "e8m0_decode")
    return _lookup(_e8m0_lut(scale_bytes.device), scale_bytes)


def e4m3_block_scales(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Per-block scales ``e4m3(max(amax, 6*2**-9) / 6)`` as float32 [..., d // block].

    Each value is exactly representable in float8_e4m3fn, and it is the divisor the quantizer
    uses, so the stored scale and the one used agree bit for bit.
    """
    _check_float_rows(x, block, "e4m3_block_scales", paired=False)
    return _e4m3_scales(_block_amax(x, block)[1]).float()


def e8m0_block_scales(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per-block power-of-two scales ``2**ceil(log2(max(amax, 6*2**-126) / 6))``, float32."""
    _check_float_rows(x, block, "e8m0_block_scales", paired=False)
    amax = _block_amax(x, block)[1]
    return e8m0_decode(_e8m0_bytes(amax, E8M0_AMAX_FLOOR, E2M1_MAX))


# ---------------------------------------------------------------------------------------------
# Packed containers


@dataclass(frozen=True, slots=True, eq=False)
class PackedFP4:
    """Block-scaled E2M1 rows; the in-memory form of one stored FP4 entry per row.

    ``eq=False``: tensors have no truth value, so identity is the only sane equality.
    """

    codes: torch.Tensor  # uint8 [..., d // 2], element 2i in the low nibble
    scales: torch.Tensor  # uint8 [..., d // block]: float8_e4m3fn bits ("e4m3") or biased E8M0 ("e8m0")
    block: int  # elements per scale
    scale_format: str  # "e4m3" or "e8m0"

    def __post_init__(self) -> None:
        _check_uint8(self.codes, "codes", "PackedFP4")
        _check_uint8(self.scales, "scales", "PackedFP4")
        _check_block(self.block, "PackedFP4")
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(f"PackedFP4: scale_format must be one of {SCALE_FORMATS}, got {self.scale_format!r}")
        if self.codes.shape[:-1] != self.scales.shape[:-1]:
            raise ValueError(f"PackedFP4: codes {tuple(self.codes.shape)} and scales "
                             f"{tuple(self.scales.shape)} disagree on the leading shape")
        dim = 2 * self.codes.shape[-1]
        if dim % self.block or self.scales.shape[-1] != dim // self.block:
            raise ValueError(f"PackedFP4: {dim} values need {dim / self.block:g} scales of block={self.block}, "
                             f"got {self.scales.shape[-1]}")

    @property
    def dim(self) -> int:
        """Values per row (d)."""
        return 2 * self.codes.shape[-1]

    def nbytes_per_row(self) -> int:
        """Stored bytes per row: d/2 code bytes + d/block scale bytes."""
        return self.codes.shape[-1] + self.scales.shape[-1]


@dataclass(frozen=True, slots=True, eq=False)
class PackedFP8:
    """Block-scaled E4M3 rows (SWA rings on the GPU path)."""

    values: torch.Tensor  # uint8 [..., d]: float8_e4m3fn bits
    scales: torch.Tensor  # uint8 [..., d // block]: biased E8M0 exponent
    block: int  # elements per scale

    def __post_init__(self) -> None:
        _check_uint8(self.values, "values", "PackedFP8")
        _check_uint8(self.scales, "scales", "PackedFP8")
        _check_block(self.block, "PackedFP8")
        if self.values.shape[:-1] != self.scales.shape[:-1]:
            raise ValueError(f"PackedFP8: values {tuple(self.values.shape)} and scales "
                             f"{tuple(self.scales.shape)} disagree on the leading shape")
        dim = self.values.shape[-1]
        if dim % self.block or self.scales.shape[-1] != dim // self.block:
            raise ValueError(f"PackedFP8: {dim} values need {dim / self.block:g} scales of block={self.block}, "
                             f"got {self.scales.shape[-1]}")

    @property
    def dim(self) -> int:
        """Values per row (d)."""
        return self.values.shape[-1]

    def nbytes_per_row(self) -> int:
        """Stored bytes per row: d value bytes + d/block scale bytes."""
        return self.values.shape[-1] + self.scales.shape[-1]


# ---------------------------------------------------------------------------------------------
# FP4 quantize / dequantize


def _kernels_for(t: torch.Tensor, dim: int, block: int):
    """The Triton kernels (triton_codecs) when `t` is on CUDA and they fit the shape, else None.

    CPU tensors always take the torch code below, so CPU results never depend on whether
    triton is installed; on CUDA the kernels are bit-identical to it (tests/gpu).
    """
    if t.device.type != "cuda":
        return None
    nb = dim // block
    if nb & (nb - 1) or block & (block - 1) or block % 2:
        return None
    from . import triton_codecs  # lazy: triton_codecs imports this module

    return triton_codecs if triton_codecs.available(t.device) else None



def _quantize_fp4(blocks: torch.Tensor, scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """float32 [..., nb, block] and float32 scales [..., nb] -> packed codes [..., d // 2].

    Dividing by s/4 gives 4 * (x / s) directly (s/4 is exact and both are correctly rounded
    quotients), so clamping to +-24 is the spec's clamp to +-6 in quarter units.
    """
    t = blocks / (scale * 0.25).unsqueeze(-1)
    codes = _encode_quarters(t.clamp_(-4 * E2M1_MAX, 4 * E2M1_MAX))
    return pack_e2m1(codes.reshape(shape))


def quantize_fp4_e4m3(x: torch.Tensor, block: int = 16) -> PackedFP4:
    """Main global KV: E2M1 codes with one E4M3 scale per ``block`` (512-d -> 288 B a row)."""
    _check_float_rows(x, block, "quantize_fp4_e4m3", paired=True)
    kernels = _kernels_for(x, x.shape[-1], block)
    if kernels is not None:
        return kernels.quantize_fp4_e4m3(x, block)
    blocks, amax = _block_amax(x, block)
    scale8 = _e4m3_scales(amax)
    codes = _quantize_fp4(blocks, scale8.float(), x.shape)
    return PackedFP4(codes=codes, scales=scale8.view(torch.uint8), block=block, scale_format="e4m3")


def quantize_fp4_e8m0(x: torch.Tensor, block: int = 32) -> PackedFP4:
    """Index keys: E2M1 codes with one power-of-two scale per ``block`` (128-d -> 68 B a row)."""
    _check_float_rows(x, block, "quantize_fp4_e8m0", paired=True)
    kernels = _kernels_for(x, x.shape[-1], block)
    if kernels is not None:
        return kernels.quantize_fp4_e8m0(x, block)
    blocks, amax = _block_amax(x, block)
    scale_bytes = _e8m0_bytes(amax, E8M0_AMAX_FLOOR, E2M1_MAX)
    codes = _quantize_fp4(blocks, e8m0_decode(scale_bytes), x.shape)
    return PackedFP4(codes=codes, scales=scale_bytes, block=block, scale_format="e8m0")


def _decode_scales(p: PackedFP4) -> torch.Tensor:
    if p.scale_format == "e4m3":
        return p.scales.view(torch.float8_e4m3fn).float()
    return e8m0_decode(p.scales)


def dequantize_fp4(p: PackedFP4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PackedFP4 -> [..., d] values of ``dtype`` (computed exactly in float32, then cast)."""
    kernels = _kernels_for(p.codes, p.dim, p.block)
    if kernels is not None:
        return kernels.dequantize_fp4(p, dtype)
    lead, nb = p.codes.shape[:-1], p.scales.shape[-1]
    pairs = _lookup(_e2m1_pair_lut(p.codes.device), p.codes)  # [..., d/2, 2]
    values = pairs.view(*lead, nb, p.block).mul_(_decode_scales(p).unsqueeze(-1))
    return values.view(*lead, p.dim).to(dtype)


def gather_dequantize_fp4(p: PackedFP4, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows `index` (any shape; -1 reads row 0) of [E, d/2] packed entries -> [*index.shape, d] values.

    Equal to ``dequantize_fp4(p, dtype)[index.clamp(min=0)]``, but decodes only the selected
    rows (decode attention reads k of E entries). On CUDA one fused Triton kernel does it.
    """
    if p.codes.dim() != 2:
        raise ValueError(f"gather_dequantize_fp4: entries must be [E, d/2], got {tuple(p.codes.shape)}")
    kernels = _kernels_for(p.codes, p.dim, p.block)
    if kernels is not None:
        return kernels.gather_dequantize_fp4(p, index, dtype)
    rows = index.reshape(-1).clamp(min=0)
    picked = PackedFP4(p.codes.index_select(0, rows), p.scales.index_select(0, rows), p.block, p.scale_format)
    return dequantize_fp4(picked, dtype).view(*index.shape, p.dim)


# ---------------------------------------------------------------------------------------------
# FP8 (SWA rings)


def quantize_fp8_e8m0(x: torch.Tensor, block: int = 32) -> PackedFP8:
    """E4M3 values with one power-of-two scale per ``block`` (512-d -> 528 B a row).

    scale = 2**ceil(log2(max(amax, 448*2**-126) / 448)); x / scale is clamped to +-448 before the
    float8 cast because only the CPU saturates out-of-range values (other builds give NaN).
    """
    _check_float_rows(x, block, "quantize_fp8_e8m0", paired=False)
    blocks, amax = _block_amax(x, block)
    scale_bytes = _e8m0_bytes(amax, FP8_E8M0_AMAX_FLOOR, E4M3_MAX)
    y = (blocks / e8m0_decode(scale_bytes).unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
    values = y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape)
    return PackedFP8(values=values, scales=scale_bytes, block=block)


def dequantize_fp8(p: PackedFP8, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """PackedFP8 -> [..., d] values of ``dtype`` (upcast to float32 first: fp8 has no arithmetic)."""
    lead, nb = p.values.shape[:-1], p.scales.shape[-1]
    values = p.values.view(torch.float8_e4m3fn).float().reshape(*lead, nb, p.block)
    values = values.mul_(e8m0_decode(p.scales).unsqueeze(-1))
    return values.reshape(*lead, p.dim).to(dtype)


# ---------------------------------------------------------------------------------------------
# Row sizes and bytes


def fp4_row_bytes(dim: int, block: int) -> int:
    """Stored bytes of one FP4 row: dim/2 codes + dim/block scales."""
    _check_block(block, "fp4_row_bytes")
    if not isinstance(dim, int) or dim <= 0 or dim % block or dim % 2:
        raise ValueError(f"fp4_row_bytes: dim must be a positive even multiple of block={block}, got {dim!r}")
    return dim // 2 + dim // block


def fp8_row_bytes(dim: int, block: int) -> int:
    """Stored bytes of one FP8 row: dim values + dim/block scales."""
    _check_block(block, "fp8_row_bytes")
    if not isinstance(dim, int) or dim <= 0 or dim % block:
        raise ValueError(f"fp8_row_bytes: dim must be a positive multiple of block={block}, got {dim!r}")
    return dim + dim // block


def to_bytes(p: PackedFP4 | PackedFP8) -> bytes:
    """Row-major bytes: each row's codes (or values) then its scales, so a row is one entry.

    Leading dims are flattened into rows; CUDA tensors are copied to the host.
    """
    if isinstance(p, PackedFP4):
        payload = p.codes
    elif isinstance(p, PackedFP8):
        payload = p.values
    else:
        raise ValueError(f"to_bytes: expected PackedFP4 or PackedFP8, got {type(p).__name__}")
    width, nb = payload.shape[-1], p.scales.shape[-1]
    rows = math.prod(payload.shape[:-1])
    out = bytearray(rows * (width + nb))
    if rows:
        dst = torch.frombuffer(out, dtype=torch.uint8).view(rows, width + nb)
        dst[:, :width].copy_(payload.reshape(rows, width))
        dst[:, width:].copy_(p.scales.reshape(rows, nb))
    return bytes(out)


def _rows_from_bytes(buf: bytes | memoryview, rows: int, row_bytes: int, fn: str) -> torch.Tensor:
    """Validated buffer -> fresh uint8 [rows, row_bytes] (a copy: the caller's buffer may be read-only)."""
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"{fn}: rows must be a non-negative int, got {rows!r}")
    nbytes = memoryview(buf).nbytes
    if nbytes != rows * row_bytes:
        raise ValueError(f"{fn}: buffer holds {nbytes} bytes, expected rows * row_bytes = "
                         f"{rows} * {row_bytes} = {rows * row_bytes}")
    if rows == 0:
        return torch.empty(0, row_bytes, dtype=torch.uint8)
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).view(rows, row_bytes)


def fp4_from_bytes(buf: bytes | memoryview, rows: int, dim: int, block: int, scale_format: str) -> PackedFP4:
    """Inverse of :func:`to_bytes` for FP4: ``rows`` entries of ``dim`` values -> PackedFP4 [rows, ...]."""
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"fp4_from_bytes: scale_format must be one of {SCALE_FORMATS}, got {scale_format!r}")
    table = _rows_from_bytes(buf, rows, fp4_row_bytes(dim, block), "fp4_from_bytes")
    return PackedFP4(codes=table[:, : dim // 2].contiguous(), scales=table[:, dim // 2 :].contiguous(),
                     block=block, scale_format=scale_format)


def fp8_from_bytes(buf: bytes | memoryview, rows: int, dim: int, block: int = 32) -> PackedFP8:
    """Inverse of :func:`to_bytes` for FP8: ``rows`` entries of ``dim`` values -> PackedFP8 [rows, ...]."""
    table = _rows_from_bytes(buf, rows, fp8_row_bytes(dim, block), "fp8_from_bytes")
    return PackedFP8(values=table[:, :dim].contiguous(), scales=table[:, dim:].contiguous(), block=block)
