"""DeepSeek-V4.1 number formats: UE8M0, MXFP8, MXFP4, NVFP4 and FP8 block weights (the cache
records built from them: `records.py`).

Bit-exact with spec section 6 (`../spec/v41-attention.md`): every rounding is round-to-nearest-even
and every power-of-two scale follows the spec's bit rule (`pow2_ceil_scale`). Plain, vectorized
PyTorch that gives the same bits on the CPU and the GPU. The arithmetic is FP32; inputs of other
float dtypes are converted to FP32 first (exact for BF16 and FP16).

Codes times scales are exact in BF16 (but at the top of BF16's range, |x| of about 2^128, where
a code rounded up times its scale is 2^128: inf; MXFP8 from 0x7F78, MXFP4 from about 3.5 * 2^126), so for each format
`*_fake(x)` (quantize, then dequantize) equals the dequantized codes bit for bit (and so does
`records.unpack_*(records.pack_*(x))`).

Non-finite inputs are not representable: an MXFP8 / MXFP4 block holding an inf or NaN gets a NaN
scale (UE8M0 byte 0xFF), so it dequantizes to NaN instead of to a plausible wrong value. An NVFP4
group's E4M3 scale has no such code: a NaN amax gives a NaN scale, an inf one saturates to 448, as
the FP32 -> E4M3 cast (torch's `float8_e4m3fn`, the official code's) saturates it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MXFP8_AMAX_FLOOR = 1e-4
MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126
NVFP4_AMAX_FLOOR = 6.0 * 2.0**-9


# --- argument checks ------------------------------------------------------------------------------


def _require_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _require_float(x, name: str, scalar_ok: bool = False) -> None:
    _require_tensor(x, name)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() == 0 and not scalar_ok:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")


def _require_dtype(x, name: str, dtypes: tuple[torch.dtype, ...], scalar_ok: bool = False) -> None:
    _require_tensor(x, name)
    if x.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {expected}, got {x.dtype}")
    if x.dim() == 0 and not scalar_ok:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d tensor")


def _require_positive_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _require_last_dim(x: torch.Tensor, name: str, size: int) -> None:
    if x.shape[-1] != size:
        raise ValueError(f"{name} must have last dimension {size}, got shape {tuple(x.shape)}")


def _as_blocks(x: torch.Tensor, name: str, block: int, block_name: str) -> torch.Tensor:
    """x as FP32 [..., K/block, block], after checking that K is a multiple of block."""
    _require_float(x, name)
    _require_positive_int(block, block_name)
    k = x.shape[-1]
    if k % block:
        raise ValueError(f"{name}: last dimension K={k} must be a multiple of {block_name}={block}")
    return x.float().reshape(*x.shape[:-1], k // block, block)


def _require_scale_shape(data_shape, scales: torch.Tensor, k: int, block: int, names: str) -> None:
    expected = (*data_shape[:-1], k // block) if k % block == 0 else None
    if expected is None or tuple(scales.shape) != expected:
        raise ValueError(
            f"{names}: scales must have shape {expected} for K={k} elements in blocks of {block}, "
            f"got {tuple(scales.shape)}"
        )


# --- UE8M0 and the power-of-two scale rule --------------------------------------------------------


def _exp2_fp32(e: torch.Tensor) -> torch.Tensor:
    """2^e as FP32, built from its bits (exact, same on every device); int e in [-149, 127]."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _ue8m0_bits(b: torch.Tensor, name: str, scalar_ok: bool = False) -> torch.Tensor:
    _require_dtype(b, name, (torch.uint8, torch.float8_e8m0fnu), scalar_ok)
    return b.view(torch.uint8)


def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale value 2^(b - 127) as FP32; byte 255 is NaN (UE8M0 has no zero).

    b: [...] uint8 bytes, or float8_e8m0fnu. Byte 0 gives 2^-127, an FP32 subnormal.
    Returns float32 [...].
    """
    bits = _ue8m0_bits(b, "b", scalar_ok=True)
    return torch.where(bits == 255, torch.nan, _exp2_fp32(bits.to(torch.int32) - 127))


def ue8m0_encode_exponent(e: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte 127 + e of the power-of-two scale 2^e.

    e: [...] integer tensor, every value in [-127, 127] (checked; 128 would be the NaN byte).
    Returns uint8 [...].
    """
    _require_tensor(e, "e")
    if e.is_floating_point() or e.is_complex() or e.dtype == torch.bool:
        raise TypeError(f"e must be an integer tensor of exponents, got dtype {e.dtype}")
    if e.numel() and (int(e.min()) < -127 or int(e.max()) > 127):
        raise ValueError(
            f"e must lie in [-127, 127] to be a UE8M0 exponent, got values in "
            f"[{int(e.min())}, {int(e.max())}]"
        )
    return (e.to(torch.int32) + 127).to(torch.uint8)


def _ue8m0_from_exponent(k: torch.Tensor) -> torch.Tensor:
    # Unchecked: the amax floors keep k >= -126; a non-finite amax gives k = 128 or 129, which
    # saturates to 255, the NaN byte, so such a block dequantizes to NaN.
    return (k + 127).clamp(max=255).to(torch.uint8)


def pow2_ceil_scale(amax_fp32: torch.Tensor, inv_qmax: float) -> torch.Tensor:
    """Exponent k of the scale s = 2^k = 2^ceil(log2(amax * inv_qmax)), by the spec's bit rule.

    The product p = amax * fp32(inv_qmax) is rounded to FP32; k is the unbiased exponent of p, plus
    one when p's mantissa bits are non-zero. For an FP32-subnormal p = m * 2^-149, k is
    ceil(log2(p)) = ceil(log2(m)) - 149, read the same way from the bits of float(m).

    amax_fp32: [...] float, converted to FP32; positive and finite (unchecked: the quantizers floor
        amax; an infinite p gives 128, a NaN p 129, p = 0 a meaningless value; the sign is ignored).
    inv_qmax: 1 / (largest code), e.g. 1/448 for E4M3 or 1/6 for E2M1; rounded to FP32.
    Returns int32 [...].
    """
    _require_tensor(amax_fp32, "amax_fp32")
    if not amax_fp32.is_floating_point():
        raise TypeError(f"amax_fp32 must be a floating-point tensor, got dtype {amax_fp32.dtype}")
    if not isinstance(inv_qmax, (int, float)) or not 0 < inv_qmax < math.inf:
        raise ValueError(f"inv_qmax must be a positive finite number, got {inv_qmax!r}")
    # An FP32 product of two FP32 values: computing it in double and rounding once gives the
    # same bits, so the device's scalar handling cannot change the result.
    p = amax_fp32.float() * float(torch.tensor(inv_qmax, dtype=torch.float32))
    bits = p.view(torch.int32) & 0x7FFFFFFF
    exponent = bits >> 23
    mantissa = bits & 0x7FFFFF
    k_normal = exponent - 127 + (mantissa != 0).to(torch.int32)
    # m < 2^23 is exact as a normal FP32 value, so the same rule on its bits gives ceil(log2(m)).
    m_bits = mantissa.float().view(torch.int32)
    k_subnormal = (m_bits >> 23) - 127 + ((m_bits & 0x7FFFFF) != 0).to(torch.int32) - 149
    return torch.where(exponent == 0, k_subnormal, k_normal)


# --- E4M3 and E2M1 codes --------------------------------------------------------------------------


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    # torch's FP32 -> E4M3 cast rounds to nearest even (tests/test_formats.py checks every
    # midpoint); the clamp keeps the result finite whatever the cast does past 448. Devices set a
    # NaN's sign bit differently, so NaNs become one canonical NaN (code 0x7F) to keep records
    # bit-identical across devices.
    v = v.clamp(-E4M3_MAX, E4M3_MAX)
    return torch.where(torch.isnan(v), torch.nan, v).to(torch.float8_e4m3fn)


def _e4m3_codes(codes: torch.Tensor, name: str) -> torch.Tensor:
    _require_dtype(codes, name, (torch.float8_e4m3fn, torch.uint8))
    return codes.view(torch.float8_e4m3fn)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 code (0..15) of v, rounded to nearest even on the grid {0, .5, 1, 1.5, 2, 3, 4, 6}.

    Code layout (OCP FP4): bit 3 sign, bits 2..1 exponent, bit 0 mantissa; magnitudes 0..7 are
    0, .5, 1, 1.5, 2, 3, 4, 6. Magnitudes above 6 saturate to 6; the sign bit is v's, so small
    negative values give code 8 (-0). E2M1 has no NaN: a NaN gives code 0 whatever its sign bit
    (which devices set differently).

    v: [...] float (converted to FP32).
    Returns uint8 [...].
    """
    _require_float(v, "v", scalar_ok=True)
    a = v.float().abs()
    # Each threshold is the midpoint between two neighbours; ">" at a midpoint whose lower
    # neighbour has the even code, ">=" where the upper one does, so ties go to the even code.
    magnitude = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    negative = torch.signbit(v) & ~torch.isnan(v)
    return magnitude | (negative.to(torch.uint8) << 3)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """FP32 value of uint8 codes in 0..15 (unchecked)."""
    exponent = ((codes >> 1) & 3).to(torch.int32)
    mantissa = (codes & 1).to(torch.float32)
    magnitude = torch.where(
        exponent == 0, 0.5 * mantissa, _exp2_fp32(exponent - 1) * (1.0 + 0.5 * mantissa)
    )
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """FP32 value of E2M1 codes (layout as in `e2m1_encode`; code 8 is -0.0).

    codes: [...] uint8, every value in 0..15 (checked).
    Returns float32 [...].
    """
    _require_dtype(codes, "codes", (torch.uint8,), scalar_ok=True)
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"codes must lie in 0..15 to be E2M1 codes, got a maximum of {int(codes.max())}")
    return _e2m1_values(codes)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K] codes (K even) -> uint8 [..., K/2]: element 2i in the low nibble, 2i+1 high."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] codes; inverse of `_pack_nibbles`."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _require_even_k(x: torch.Tensor, name: str) -> None:
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: last dimension K={x.shape[-1]} must be even to pack two E2M1 codes per byte")


# --- MXFP8 ----------------------------------------------------------------------------------------


def mxfp8_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 codes e4m3(clamp(x / s, +-448)) with one scale s = 2^ceil(log2(amax / 448)) per block.

    amax = max(|x|, 1e-4) over each block of `block` consecutive elements of the last dimension;
    s by the bit rule of `pow2_ceil_scale` with 1/448; codes rounded to nearest even.

    x: [..., K] float (converted to FP32), K a multiple of block.
    block: elements per scale (32 in the model).
    Returns (codes float8_e4m3fn [..., K], scales uint8 [..., K/block] UE8M0 bytes).
    """
    xb = _as_blocks(x, "x", block, "block")  # [..., K/block, block]
    amax = xb.abs().amax(dim=-1).clamp(min=MXFP8_AMAX_FLOOR)
    scales = _ue8m0_from_exponent(pow2_ceil_scale(amax, 1.0 / E4M3_MAX))
    codes = _e4m3(xb / ue8m0_decode(scales).unsqueeze(-1))
    return codes.reshape(x.shape), scales


def mxfp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int = 32) -> torch.Tensor:
    """codes * 2^(scale - 127), each scale byte applying to `block` consecutive elements.

    codes: [..., K] float8_e4m3fn (or uint8 holding its bytes).
    scales: [..., K/block] uint8 UE8M0 bytes (or float8_e8m0fnu).
    block: elements per scale (32 in the model).
    Returns float32 [..., K] (exact in BF16).
    """
    codes = _e4m3_codes(codes, "codes")
    scale_bits = _ue8m0_bits(scales, "scales")
    _require_positive_int(block, "block")
    k = codes.shape[-1]
    _require_scale_shape(codes.shape, scale_bits, k, block, "mxfp8_dequantize")
    values = codes.float().reshape(*codes.shape[:-1], k // block, block)
    return (values * ue8m0_decode(scale_bits).unsqueeze(-1)).reshape(codes.shape)


def mxfp8_fake(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP8 quantize-dequantize of x, in x's dtype.

    x: [..., K] float, K a multiple of block.
    block: elements per scale (32 in the model).
    Returns [..., K] of x.dtype.
    """
    return mxfp8_dequantize(*mxfp8_quantize(x, block), block).to(x.dtype)


# --- MXFP4 ----------------------------------------------------------------------------------------


def mxfp4_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 codes e2m1(clamp(x / s, +-6)) with one scale s = 2^ceil(log2(amax / 6)) per block.

    amax = max(|x|, 6 * 2^-126) over each block; s by the bit rule of `pow2_ceil_scale` with 1/6;
    codes rounded to nearest even (`e2m1_encode`), packed two per byte, low nibble = even element.

    x: [..., K] float (converted to FP32), K a multiple of block and even.
    block: elements per scale (32 in the model).
    Returns (packed uint8 [..., K/2], scales uint8 [..., K/block] UE8M0 bytes).
    """
    xb = _as_blocks(x, "x", block, "block")  # [..., K/block, block]
    _require_even_k(x, "x")
    amax = xb.abs().amax(dim=-1).clamp(min=MXFP4_AMAX_FLOOR)
    scales = _ue8m0_from_exponent(pow2_ceil_scale(amax, 1.0 / E2M1_MAX))
    codes = e2m1_encode((xb / ue8m0_decode(scales).unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return _pack_nibbles(codes.reshape(x.shape)), scales


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, block: int = 32) -> torch.Tensor:
    """e2m1(code) * 2^(scale - 127), each scale byte applying to `block` consecutive elements.

    packed: [..., K/2] uint8, element 2i in the low nibble of byte i, 2i+1 in the high nibble.
    scales: [..., K/block] uint8 UE8M0 bytes (or float8_e8m0fnu).
    block: elements per scale (32 in the model).
    Returns float32 [..., K] (exact in BF16).
    """
    _require_dtype(packed, "packed", (torch.uint8,))
    scale_bits = _ue8m0_bits(scales, "scales")
    _require_positive_int(block, "block")
    codes = _unpack_nibbles(packed)
    k = codes.shape[-1]
    _require_scale_shape(codes.shape, scale_bits, k, block, "mxfp4_dequantize")
    values = _e2m1_values(codes).reshape(*codes.shape[:-1], k // block, block)
    return (values * ue8m0_decode(scale_bits).unsqueeze(-1)).reshape(codes.shape)


def mxfp4_fake(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP4 quantize-dequantize of x, in x's dtype.

    x: [..., K] float, K a multiple of block and even.
    block: elements per scale (32 in the model).
    Returns [..., K] of x.dtype.
    """
    return mxfp4_dequantize(*mxfp4_quantize(x, block), block).to(x.dtype)


# --- NVFP4 ----------------------------------------------------------------------------------------


def nvfp4_quantize(x: torch.Tensor, group: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 codes e2m1(clamp(x / s, +-6)) with one E4M3 scale s = e4m3(max(amax, 6 * 2^-9) / 6) per group.

    amax over each group of `group` elements; the division by 6 is FP32, then rounded to nearest
    even E4M3 (saturating at 448, so amax up to 2688 is represented faithfully); x / s is an FP32
    division by the scale's value; codes as in `e2m1_encode`, packed two per byte, low nibble =
    even element.

    x: [..., K] float (converted to FP32), K a multiple of group and even.
    group: elements per scale (16 in the model).
    Returns (packed uint8 [..., K/2], scales float8_e4m3fn [..., K/group]).
    """
    xg = _as_blocks(x, "x", group, "group")  # [..., K/group, group]
    _require_even_k(x, "x")
    amax = xg.abs().amax(dim=-1).clamp(min=NVFP4_AMAX_FLOOR)
    # A tensor divisor, not a Python 6: CUDA turns division by a CPU scalar into multiplication
    # by its rounded reciprocal, which rounds differently from the spec's division.
    scales = _e4m3(amax / torch.full_like(amax, E2M1_MAX))
    codes = e2m1_encode((xg / scales.float().unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX))
    return _pack_nibbles(codes.reshape(x.shape)), scales


def nvfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor, group: int = 16) -> torch.Tensor:
    """e2m1(code) * s, each E4M3 scale s applying to `group` consecutive elements.

    packed: [..., K/2] uint8, element 2i in the low nibble of byte i, 2i+1 in the high nibble.
    scales: [..., K/group] float8_e4m3fn (or uint8 holding its bytes).
    group: elements per scale (16 in the model).
    Returns float32 [..., K] (exact in BF16).
    """
    _require_dtype(packed, "packed", (torch.uint8,))
    scales = _e4m3_codes(scales, "scales")
    _require_positive_int(group, "group")
    codes = _unpack_nibbles(packed)
    k = codes.shape[-1]
    _require_scale_shape(codes.shape, scales, k, group, "nvfp4_dequantize")
    values = _e2m1_values(codes).reshape(*codes.shape[:-1], k // group, group)
    return (values * scales.float().unsqueeze(-1)).reshape(codes.shape)


def nvfp4_fake(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """NVFP4 quantize-dequantize of x, in x's dtype.

    x: [..., K] float, K a multiple of group and even.
    group: elements per scale (16 in the model).
    Returns [..., K] of x.dtype.
    """
    return nvfp4_dequantize(*nvfp4_quantize(x, group), group).to(x.dtype)


# --- FP8 checkpoint weights -----------------------------------------------------------------------


def fp8_block_quantize(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint FP8 weight e4m3(clamp(w / s, +-448)), one UE8M0 scale s per block x block tile.

    s = 2^ceil(log2(max(amax, 1e-4) / 448)) over each tile, by the bit rule of `pow2_ceil_scale`;
    the tiles at the bottom and right edges may be partial.

    w: [out, in] float (converted to FP32); out and in need not be multiples of block.
    block: tile side (32 in the checkpoint).
    Returns (weight float8_e4m3fn [out, in], scale float8_e8m0fnu [ceil(out/block), ceil(in/block)]).
    """
    _require_float(w, "w")
    _require_positive_int(block, "block")
    if w.dim() != 2:
        raise ValueError(f"w must be a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    # Zero padding cannot raise a tile's amax, so the partial tiles keep their own scale.
    padded = F.pad(w.float(), (0, cols * block - in_dim, 0, rows * block - out_dim))
    tiles = padded.reshape(rows, block, cols, block)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=MXFP8_AMAX_FLOOR)  # [rows, cols]
    scale = _ue8m0_from_exponent(pow2_ceil_scale(amax, 1.0 / E4M3_MAX))
    codes = _e4m3(tiles / ue8m0_decode(scale)[:, None, :, None])
    weight = codes.reshape(rows * block, cols * block)[:out_dim, :in_dim].contiguous()
    return weight, scale.view(torch.float8_e8m0fnu)


def fp8_block_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Element (r, c) = weight[r, c] * scale[r // block, c // block].

    weight: [out, in] float8_e4m3fn (or uint8 holding its bytes).
    scale: [ceil(out/block), ceil(in/block)] float8_e8m0fnu (or uint8 UE8M0 bytes).
    block: tile side (32 in the checkpoint).
    Returns float32 [out, in] (exact in BF16).
    """
    weight = _e4m3_codes(weight, "weight")
    scale_bits = _ue8m0_bits(scale, "scale")
    _require_positive_int(block, "block")
    if weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D [out, in] tensor, got shape {tuple(weight.shape)}")
    out_dim, in_dim = weight.shape
    expected = (-(-out_dim // block), -(-in_dim // block))
    if tuple(scale_bits.shape) != expected:
        raise ValueError(
            f"scale must have shape {expected} for a weight of shape {(out_dim, in_dim)} in "
            f"{block}x{block} tiles, got {tuple(scale_bits.shape)}"
        )
    s = ue8m0_decode(scale_bits).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return weight.float() * s[:out_dim, :in_dim]
