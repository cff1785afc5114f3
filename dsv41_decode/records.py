"""The DeepSeek-V4.1 cache records (spec section 6): 528-byte window KV (MXFP8), 288-byte
compressed KV (NVFP4) and 68-byte index keys (MXFP4), one row of uint8 each, packed from and
unpacked to BF16 values with the number formats of `formats.py`, bit for bit.

`unpack_*(pack_*(x))` equals the format's `*_fake(x)` in BF16. The byte layout is documented once,
below, above `pack_window_kv`; the kernels that read or write records (`ops.kv_write`,
`ops.sparse_mla`, `ops.indexer`) follow it.
"""

from __future__ import annotations

import torch

from .formats import (_require_dtype, _require_float, _require_last_dim, mxfp4_dequantize, mxfp4_quantize,
                      mxfp8_dequantize, mxfp8_quantize, nvfp4_dequantize, nvfp4_quantize)

WINDOW_KV_BYTES = 528
COMPRESSED_KV_BYTES = 288
INDEX_KEY_BYTES = 68

_WINDOW_KV_DIM = 512
_COMPRESSED_KV_DIM = 512
_INDEX_KEY_DIM = 128

# --- cache records --------------------------------------------------------------------------------
#
# Each record is one row of uint8; data bytes first, scale bytes last, so that a kernel reads the
# data with aligned 16-byte vector loads and the scales with one more load. Offsets are in bytes
# from the start of the record; element i is entry i of the 512-vector (128 for the index key).
#
#   window KV      528 B  [0, 512)    E4M3 code of element i at byte i
#                         [512, 528)  UE8M0 scale of elements 32j .. 32j+31 at byte 512 + j
#   compressed KV  288 B  [0, 256)    E2M1 codes of elements 2i (low nibble), 2i+1 (high) at byte i
#                         [256, 288)  E4M3 scale of elements 16g .. 16g+15 at byte 256 + g
#   index key       68 B  [0, 64)     E2M1 codes of elements 2i (low nibble), 2i+1 (high) at byte i
#                         [64, 68)    UE8M0 scale of elements 32j .. 32j+31 at byte 64 + j
#
# 528 = 33 * 16 and 288 = 18 * 16 keep every record of a contiguous cache 16-byte aligned, and
# 68 = 17 * 4 keeps index keys 4-byte aligned.


def _require_record(rec: torch.Tensor, name: str, size: int) -> None:
    _require_dtype(rec, name, (torch.uint8,))
    _require_last_dim(rec, name, size)


def pack_window_kv(x: torch.Tensor) -> torch.Tensor:
    """528-byte window-KV records of x: MXFP8 (blocks of 32) codes, then the 16 UE8M0 scales.

    x: [..., 512] float.
    Returns uint8 [..., 528].
    """
    _require_float(x, "x")
    _require_last_dim(x, "x", _WINDOW_KV_DIM)
    codes, scales = mxfp8_quantize(x, 32)
    return torch.cat((codes.view(torch.uint8), scales), dim=-1)


def unpack_window_kv(rec: torch.Tensor) -> torch.Tensor:
    """The BF16 values of 528-byte window-KV records (equal to `mxfp8_fake` of the packed input).

    rec: [..., 528] uint8.
    Returns bfloat16 [..., 512].
    """
    _require_record(rec, "rec", WINDOW_KV_BYTES)
    return mxfp8_dequantize(rec[..., :_WINDOW_KV_DIM], rec[..., _WINDOW_KV_DIM:], 32).to(torch.bfloat16)


def pack_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    """288-byte compressed-KV records of x: NVFP4 (groups of 16) code pairs, then the 32 E4M3 scales.

    x: [..., 512] float.
    Returns uint8 [..., 288].
    """
    _require_float(x, "x")
    _require_last_dim(x, "x", _COMPRESSED_KV_DIM)
    packed, scales = nvfp4_quantize(x, 16)
    return torch.cat((packed, scales.view(torch.uint8)), dim=-1)


def unpack_compressed_kv(rec: torch.Tensor) -> torch.Tensor:
    """The BF16 values of 288-byte compressed-KV records (equal to `nvfp4_fake` of the packed input).

    rec: [..., 288] uint8.
    Returns bfloat16 [..., 512].
    """
    _require_record(rec, "rec", COMPRESSED_KV_BYTES)
    data = _COMPRESSED_KV_DIM // 2
    return nvfp4_dequantize(rec[..., :data], rec[..., data:], 16).to(torch.bfloat16)


def pack_index_key(x: torch.Tensor) -> torch.Tensor:
    """68-byte index-key records of x: MXFP4 (blocks of 32) code pairs, then the 4 UE8M0 scales.

    x: [..., 128] float.
    Returns uint8 [..., 68].
    """
    _require_float(x, "x")
    _require_last_dim(x, "x", _INDEX_KEY_DIM)
    packed, scales = mxfp4_quantize(x, 32)
    return torch.cat((packed, scales), dim=-1)


def unpack_index_key(rec: torch.Tensor) -> torch.Tensor:
    """The BF16 values of 68-byte index-key records (equal to `mxfp4_fake` of the packed input).

    rec: [..., 68] uint8.
    Returns bfloat16 [..., 128].
    """
    _require_record(rec, "rec", INDEX_KEY_BYTES)
    data = _INDEX_KEY_DIM // 2
    return mxfp4_dequantize(rec[..., :data], rec[..., data:], 32).to(torch.bfloat16)
