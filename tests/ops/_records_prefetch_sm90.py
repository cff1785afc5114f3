"""Run by tests/ops/test_sparse_tables.py in a subprocess without the Triton interpreter (the kernel
must be a real JIT function to compile), and by hand: compiles `ops.sparse_tables`' records prefetch
for sm_90 at the step's shapes (a window of 128 records, with and without 512 compressed ones; at
the evict_last priority and, with them, the normal one) and prints, per form, one JSON object: its
L2 policies, hinted and all bulk prefetches in the PTX, the bulk prefetches in the SASS, registers
and local memory."""

from __future__ import annotations

import json

from dsv41_decode.ops import sparse_tables
from dsv41_decode.records import COMPRESSED_KV_BYTES, WINDOW_KV_BYTES
from dsv41_decode.testing.sm90 import compile_sm90, resources, sass

TYPES = {"win_pool": "*u8", "win_table": "*i32", "comp_pool": "*u8", "comp_table": "*i32"}


def main() -> None:
    for kc, last in ((0, True), (512, True), (512, False)):
        kernel = compile_sm90(sparse_tables._records_prefetch_kernel, TYPES,
                              dict(W=128, KC=kc, WREC=WINDOW_KV_BYTES, CREC=COMPRESSED_KV_BYTES,
                                   LANES=sparse_tables.RECORDS_PREFETCH_LANES, LAST=last), num_warps=1)
        ptx = kernel.asm["ptx"]
        print(json.dumps(dict(kc=kc, last=last, evict_last=ptx.count("createpolicy.fractional.L2::evict_last.b64"),
                              hinted=ptx.count("cp.async.bulk.prefetch.L2.global.L2::cache_hint"),
                              prefetches=ptx.count("cp.async.bulk.prefetch.L2.global"),
                              sass_prefetches=sum("UBLKPF.L2" in t for _, t in sass(kernel)),
                              **resources(kernel))))


if __name__ == "__main__":
    main()
