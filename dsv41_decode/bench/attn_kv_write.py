"""`bench attn`, record-writing family: query RoPE + window-KV insert (528 B), compressed-KV insert
(288 B), index-key insert (68 B), at V4.1-Flash sizes (64 heads), per row count."""

from __future__ import annotations

import math

import torch

from ..ops.kv_write import compressed_kv_store_, index_key_store_, qkv_rope_insert_
from .results import record
from .timing import graph_time_us

HEADS, SLOTS = 64, 1 << 16


def bench_kv_write(rows_list, floor, info, gen, progress) -> list[dict]:
    out = []
    for rows in rows_list:
        ang = torch.rand(rows, 32, generator=gen, device="cuda") * 2 * math.pi
        cos, sin = torch.cos(ang), torch.sin(ang)
        slots = torch.randperm(SLOTS, generator=gen, device="cuda")[:rows].to(torch.int64)
        q = torch.randn(rows, HEADS, 512, generator=gen, device="cuda").to(torch.bfloat16)
        kv = torch.randn(rows, 512, generator=gen, device="cuda").to(torch.bfloat16)
        lat = torch.randn(rows, 512, generator=gen, device="cuda").to(torch.bfloat16)
        wk_out = torch.randn(rows, 128, generator=gen, device="cuda")
        k_norm = torch.ones(128, device="cuda", dtype=torch.bfloat16)
        window = torch.zeros(SLOTS, 528, device="cuda", dtype=torch.uint8)
        comp = torch.zeros(SLOTS, 288, device="cuda", dtype=torch.uint8)
        keys = torch.zeros(SLOTS, 68, device="cuda", dtype=torch.uint8)
        cases = (
            # the query rotation is in place: replays rotate again, which costs the same
            ("qkv_rope_insert", lambda: qkv_rope_insert_(q, kv, cos, sin, slots, window),
             rows * (HEADS * 512 * 4 + 512 * 2 + 528 + 256)),
            ("compressed_kv_store", lambda: compressed_kv_store_(lat, cos, sin, slots, comp), rows * (1024 + 288 + 256)),
            ("index_key_store", lambda: index_key_store_(wk_out, k_norm, 1e-20, cos, sin, slots, keys),
             rows * (512 + 68 + 256)),
        )
        for name, fn, nbytes in cases:
            us = graph_time_us(fn, replays=50)
            out.append(record("attn", {"op": name, "rows": rows, "heads": HEADS}, us, nbytes, floor, {}, info))
            progress(f"{name} rows={rows}: {us:.2f} us")
    return out
