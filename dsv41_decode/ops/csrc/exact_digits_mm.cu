// The contract-exact low-batch MXFP8 linear on FP16 tensor cores over the codes' digits, in CUDA C++
// for sm_90 (ops/cuda_exact_mm.py binds, builds and launches it; docs/gemm.md, "CudaExactMM").
//
// y[m, n] = sum over K blocks kb, in K order, from 0, in FP32, of RN(RN(P[m, n, kb] * sx[m, kb]) *
// sw[n / 32, kb]), P the block's exact dot of E4M3 codes rounded once to FP32 (spec decision 1;
// reference.linear.mxfp8_mm), then rounded to BF16 (or left FP32).
//
// The block's exact dot (gluon_exact_digits.chained_dot's arithmetic): each E4M3 value v splits
// exactly into two FP16 digits, vh = v rounded to an integer ((v + 1536) - 1536 in FP16) and
// vl = v - vh (a multiple of 2^-9, |vl| <= 1/2). mid = wh.xl + wl.xh (multiples of 2^-9 below 2^14)
// as one chain of four k16 MMAs; mi = (mid + 1.5 * 2^23) - 1.5 * 2^23, mid rounded to an integer;
// then H = wh.xh + mi (integers below 2^24) and L = wl.xl + (mid - mi) (multiples of 2^-18 below
// 2^4), each a chain of two MMAs from mi / mid - mi: every partial sum (in any order) at most 24
// significant bits, exact under the FP16 MMA's adds (scripts/probe_digit_mma.py), so RN(H + L) is
// the block's exact dot rounded once.
// The MMA is mma.sync m16n8k16 with the weight rows as M (16 a warp) and x's rows as N (8 an
// n-tile); within a 32-deep block the K order is free (the block's sum is exact), so thread
// (g = lane / 4, t = lane % 4) takes bytes 8t .. 8t + 7 of each block of its rows: logical k =
// 16 s + 8 u + 2 t + v at byte 8 t + 4 s + 2 u + v, for A (weight rows g, g + 8) and B (x row g) alike.
//
// Schedule (no CTA-wide barrier in the main loop): a CTA runs the K stages of its StageRange (one
// tile of 16 MT weight rows, MT m-tiles of the MMA, and every row of x, or on a stream-K grid parts
// of several, below); its P compute warps take the stages (G blocks, 32 G bytes of each row; G = 4
// as instantiated) in turn, stage st by warp st % P, each streaming its own stages' weight and x
// bytes and their scale bytes by cp.async through a ring of S stages of its own (cp.async.wait_group
// and __syncwarp only: no load of the main loop waits on global memory but the ring's, S - 1 stages
// ahead), and writes each block's FP32 terms into a ring of R stage slots of shared memory
// (Layout::R); the CTA's last warp adds the terms in K order, one FP32 accumulator per output from 0
// or from the accumulator handed in (full / empty mbarriers per slot, 32 arrivals each), and stores y.
//
// Compiled without FMA contraction (--fmad=false) and without flushing subnormals; every rounding
// step is an explicit _rn intrinsic as well.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_cg16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_ca16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_ca4(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("{\n\t.reg .b64 state;\n\tmbarrier.arrive.shared::cta.b64 state, [%0];\n\t}\n" ::"r"(bar) : "memory");
}

// try_wait suspends the waiting warp in hardware (up to a time limit, then it tries again), so a
// waiting warp takes no issue slots from the compute warps.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n\t.reg .pred done;\n"
        "WAIT:\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
        "@!done bra WAIT;\n\t}\n" ::"r"(bar),
        "r"(parity)
        : "memory");
}

// v, kept in a register: the compiler may not re-form it from its inputs (it otherwise re-forms a
// lane's copy addresses at every stage of the main loop).
__device__ __forceinline__ uint32_t kept(uint32_t v) {
    asm volatile("mov.b32 %0, %0;\n" : "+r"(v));
    return v;
}
__device__ __forceinline__ uint64_t kept(uint64_t v) {
    asm volatile("mov.b64 %0, %0;\n" : "+l"(v));
    return v;
}
template <class T>
__device__ __forceinline__ const T* kept(const T* p) {
    return reinterpret_cast<const T*>(kept(reinterpret_cast<uint64_t>(p)));
}

// m16n8k16, FP16 operands, FP32 accumulator: d = a . b + c.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                         const float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

// Two E4M3 codes (the low byte first) as an FP16 pair (exact: every E4M3 value is an FP16 value).
__device__ __forceinline__ __half2 e4m3x2_to_half2(uint32_t two_codes) {
    __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes & 0xFFFFu), __NV_E4M3);
    return *reinterpret_cast<__half2*>(&r);
}

// The digits of an FP16 pair of E4M3 values: hi = v rounded to an integer, lo = v - hi (both exact).
__device__ __forceinline__ void digits(__half2 v, uint32_t& hi, uint32_t& lo) {
    const __half2 c = __float2half2_rn(1536.0f);
    __half2 h = __hsub2(__hadd2(v, c), c);
    __half2 l = __hsub2(v, h);
    hi = *reinterpret_cast<uint32_t*>(&h);
    lo = *reinterpret_cast<uint32_t*>(&l);
}

// Four pairs of E4M3 codes (8 bytes: words w0, w1) as the digits of the pairs p0 .. p3.
__device__ __forceinline__ void digits8(uint2 w, uint32_t (&hi)[4], uint32_t (&lo)[4]) {
    digits(e4m3x2_to_half2(w.x), hi[0], lo[0]);
    digits(e4m3x2_to_half2(w.x >> 16), hi[1], lo[1]);
    digits(e4m3x2_to_half2(w.y), hi[2], lo[2]);
    digits(e4m3x2_to_half2(w.y >> 16), hi[3], lo[3]);
}

// 2^(b - 127) for a UE8M0 byte (byte 255: NaN; byte 0: 0.0, as the Triton kernels).
__device__ __forceinline__ float ue8m0(uint32_t b) {
    return b == 255u ? __int_as_float(0x7FC00000) : __int_as_float(static_cast<int>(b << 23));
}

// Byte offset of 16-byte chunk c (0 .. 2G - 1) of row r in a stage buffer of G blocks a row: each
// row's 32-byte blocks XOR-swizzled by r % 4, so the fragment loads (rows g, 8-byte words t) hit
// distinct banks.
template <int G>
__device__ __forceinline__ int chunk_offset(int r, int c) {
    return r * 32 * G + (((c >> 1) ^ (r & 3)) << 5) + ((c & 1) << 4);
}

// Byte offset of thread (g, t)'s 8-byte word of block b of row r.
template <int G>
__device__ __forceinline__ int word_offset(int r, int b, int t) {
    return r * 32 * G + ((b ^ (r & 3)) << 5) + (t << 3);
}

template <int NT, int MT, int P, int S, int G>
struct Layout {
    static constexpr int ROW_BYTES = 32 * G;
    static constexpr int W_ROWS = 16 * MT;                  // weight rows a tile
    // Term slots (stages): with one n-tile and one m-tile 2P, with two of either P + 2 (three CTAs an
    // SM at 16 rows; measured the faster of the two counts, runs HV and HW in
    // docs/results/gpu-tests-h200.txt), with two of both P (one slot a compute warp: two CTAs an SM).
    static constexpr int R = NT * MT == 1 ? 2 * P : NT * MT == 2 ? P + 2 : P;
    static constexpr int X_ROWS = 8 * NT;
    static constexpr int SCALES_OFF = (W_ROWS + X_ROWS) * ROW_BYTES;   // sw's G bytes (16 reserved), then sx's
    static constexpr int STAGE_BYTES = SCALES_OFF + 16 + X_ROWS * G;
    static constexpr int TERM_SLOT_BYTES = G * MT * NT * 32 * 16;
    static constexpr int BAR_BYTES = 2 * R * 8;
    static constexpr int TERMS_OFF = (BAR_BYTES + 127) / 128 * 128;
    static constexpr int STAGES_OFF = TERMS_OFF + R * TERM_SLOT_BYTES;
    static constexpr int SMEM = STAGES_OFF + P * S * STAGE_BYTES;
};

// The stages of CTA c of `ctas` over the N / (16 MT) tiles' K stages laid end to end (tile t's stage s is
// unit t B + s, B stages a tile), units [c U / C, (c + 1) U / C): with ctas <= tiles each CTA's range
// spans at least one tile's B stages, so it is a tail of one tile (whose head the CTA before holds),
// whole tiles, and a head of one tile (whose tail the CTA after holds). The CTA runs them in the
// order head, whole tiles, tail: a head's accumulator goes to the next CTA early, and a tail waits
// for its head's last, so no CTA waits on one that waits. With ctas == tiles each CTA runs one tile.
struct StageRange {
    int b;                   // stages a tile
    int head0, n_head;       // units of the head (run first), its accumulator handed on
    int full0, n_full;       // units of the whole tiles
    int tail0, n_tail;       // units of the tail (run last), its accumulator handed in
    __device__ StageRange(int c, int ctas, int tiles, int b_) : b(b_) {
        const long long units = static_cast<long long>(tiles) * b;
        const int u0 = static_cast<int>(units * c / ctas), u1 = static_cast<int>(units * (c + 1) / ctas);
        const int s_first = u0 % b, t_last = (u1 - 1) / b;
        n_tail = s_first ? b - s_first : 0;
        tail0 = u0;
        n_head = u1 % b ? u1 - t_last * b : 0;
        head0 = t_last * b;
        full0 = u0 + n_tail;
        n_full = u1 - n_head - full0;
    }
    __device__ int n() const { return n_head + n_full + n_tail; }
    // Tile and stage within it of the CTA's j-th stage in run order (one division).
    __device__ void locate(int j, int& tile, int& s) const {
        const int u = j < n_head ? head0 + j : j < n_head + n_full ? full0 + j - n_head : tail0 + j - n_head - n_full;
        tile = u / b;
        s = u - tile * b;
    }
};

// A warp's walk over the stages j0, j0 + step, ... of a StageRange: within one of its three runs
// (head, whole tiles, tail) the units are consecutive, so a step moves s on by `step` (wrapping into
// the next tile) without a division; the range's `locate` only where a step enters another run.
struct Cursor {
    int j, tile, s;
    __device__ Cursor(const StageRange& r, int j0) : j(j0) { r.locate(j0, tile, s); }
    __device__ void advance(const StageRange& r, int step) {
        const int j1 = j + step, e0 = r.n_head, e1 = r.n_head + r.n_full;
        if ((j < e0) != (j1 < e0) || (j < e1) != (j1 < e1)) {
            r.locate(j1, tile, s);
        } else {
            s += step;
            while (s >= r.b) {
                s -= r.b;
                ++tile;
            }
        }
        j = j1;
    }
};

template <int NT, int MT, int P, int S, int G>
__device__ __forceinline__ void exact_digits_mm(const uint8_t* __restrict__ x, const uint8_t* __restrict__ sx,
                                                const uint8_t* __restrict__ w, const uint8_t* __restrict__ sw,
                                                void* __restrict__ out, int m, int k, int ld_x, int ld_sx,
                                                int ld_w, int ld_sw, int ld_out, int out_fp32, int tiles,
                                                float* __restrict__ handoff, int* __restrict__ flags) {
    static_assert(MT == 1 || MT == 2, "a tile is at most one 32-row group of the weight's scales");
    using L = Layout<NT, MT, P, S, G>;
    constexpr int ROW_BYTES = L::ROW_BYTES;
    constexpr int GW = G / 4;                               // scale words a stage
    extern __shared__ __align__(128) uint8_t smem[];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int c = blockIdx.x, ctas = gridDim.x;
    const StageRange range(c, ctas, tiles, k / ROW_BYTES);
    const int n_stages = range.n();
    const uint32_t bars = smem_addr(smem);                  // full[0 .. R), then empty[0 .. R)
    float4* terms = reinterpret_cast<float4*>(smem + L::TERMS_OFF);

    if (threadIdx.x == 0) {
        for (int i = 0; i < 2 * L::R; ++i) mbar_init(bars + 8 * i, 32);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    if (warp == P) {
        // The accumulating warp: each output's block terms in K order, from 0 at a tile's first stage
        // or from the head's accumulator handed in at a tail's; at a tile's last stage y is stored, at
        // a head's last the accumulator handed on (handoff[c + 1], flags[c + 1]: one writer, one reader).
        float acc[MT * NT][4];                              // [m-tile mt, n-tile j] at mt NT + j
        Cursor at(range, 0);
        for (int st = 0; st < n_stages; ++st, at.advance(range, 1)) {
            const int tile = at.tile, s_in = at.s;
            if (s_in == 0) {
#pragma unroll
                for (int j = 0; j < MT * NT; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
            } else if (st == range.n_head + range.n_full) {     // the tail's first stage
                int ready;
                do {
                    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(ready) : "l"(flags + c) : "memory");
                    if (!ready) __nanosleep(64);
                } while (!ready);
                const float4* hp = reinterpret_cast<const float4*>(handoff) + static_cast<size_t>(c) * MT * NT * 32 + lane;
#pragma unroll
                for (int j = 0; j < MT * NT; ++j) {
                    const float4 v = hp[32 * j];
                    acc[j][0] = v.x; acc[j][1] = v.y; acc[j][2] = v.z; acc[j][3] = v.w;
                }
                __syncwarp();
                if (lane == 0) flags[c] = 0;                    // ready for the next call
            }
            const int slot = st % L::R;
            mbar_wait(bars + 8 * slot, (st / L::R) & 1);
#pragma unroll
            for (int b = 0; b < G; ++b)
#pragma unroll
                for (int j = 0; j < MT * NT; ++j) {
                    const float4 v = terms[((slot * G + b) * MT * NT + j) * 32 + lane];
                    acc[j][0] = __fadd_rn(acc[j][0], v.x);
                    acc[j][1] = __fadd_rn(acc[j][1], v.y);
                    acc[j][2] = __fadd_rn(acc[j][2], v.z);
                    acc[j][3] = __fadd_rn(acc[j][3], v.w);
                }
            mbar_arrive(bars + 8 * (L::R + slot));
            if (st == range.n_head - 1) {                       // the head's last stage: hand on
                float4* hp = reinterpret_cast<float4*>(handoff) + static_cast<size_t>(c + 1) * MT * NT * 32 + lane;
#pragma unroll
                for (int j = 0; j < MT * NT; ++j) hp[32 * j] = make_float4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]);
                __threadfence();
                __syncwarp();
                if (lane == 0) asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(flags + c + 1), "r"(1) : "memory");
            } else if (s_in == range.b - 1) {
                // C fragment: acc[mt NT + j][i] is weight row 16 mt + g + 8 (i / 2) of the tile, x row
                // 8 j + 2 t + i % 2.
#pragma unroll
                for (int j = 0; j < MT * NT; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int xr = 8 * (j % NT) + 2 * t + (i & 1);
                        const int wr = tile * L::W_ROWS + 16 * (j / NT) + g + 8 * (i >> 1);
                        if (xr < m) {
                            if (out_fp32)
                                reinterpret_cast<float*>(out)[static_cast<size_t>(xr) * ld_out + wr] = acc[j][i];
                            else
                                reinterpret_cast<__nv_bfloat16*>(out)[static_cast<size_t>(xr) * ld_out + wr] =
                                    __float2bfloat16_rn(acc[j][i]);
                        }
                    }
            }
        }
        return;
    }

    // A compute warp: stages warp, warp + P, ... through its own ring of S stage buffers. Each lane's
    // copies of a stage differ from the previous stage's only in the K offset and the buffer, so
    // their offsets are formed once: weight chunk i of lane (row r0 + i 16 / G, chunk c0), x chunk i
    // (row r0 + i 16 / G), one scale copy (lanes 0 .. X_ROWS - 1 x's rows, lane X_ROWS sw's group).
    uint8_t* ring = smem + L::STAGES_OFF + warp * S * L::STAGE_BYTES;
    const int r0 = lane / (2 * G), c0 = lane % (2 * G);
    const uint8_t* w_src = kept(w + static_cast<size_t>(r0) * ld_w + 16 * c0);   // + the stage's tile rows
    uint32_t w_dst[MT * G], x_dst[NT * G / 2];
    const uint8_t* x_src[NT * G / 2];
    int x_bytes[NT * G / 2];
#pragma unroll
    for (int i = 0; i < MT * G; ++i) w_dst[i] = kept(static_cast<uint32_t>(chunk_offset<G>(r0 + i * 16 / G, c0)));
#pragma unroll
    for (int i = 0; i < NT * G / 2; ++i) {                  // x rows past m zero-filled
        const int r = r0 + i * 16 / G;
        x_dst[i] = kept(static_cast<uint32_t>(chunk_offset<G>(L::W_ROWS + r, c0)));
        x_src[i] = kept(x + static_cast<size_t>(r < m ? r : 0) * ld_x + 16 * c0);
        x_bytes[i] = r < m ? 16 : 0;
    }
    const bool scale_lane = lane <= L::X_ROWS;
    const bool sw_lane = lane == L::X_ROWS;               // its source + the stage's tile's 32-row group
    const uint8_t* s_src = kept(lane < L::X_ROWS ? sx + static_cast<size_t>(lane < m ? lane : 0) * ld_sx : sw);
    const uint32_t s_dst = L::SCALES_OFF + (lane < L::X_ROWS ? 16 + 4 * GW * lane : 0);
    const int s_bytes = lane < L::X_ROWS && lane >= m ? 0 : 4;
    const size_t w_step = kept(static_cast<uint64_t>(16 / G) * ld_w);
    const size_t tile_bytes = kept(static_cast<uint64_t>(L::W_ROWS) * ld_w);
    const size_t sw_tile_bytes = sw_lane ? ld_sw : 0;      // sw's rows: one a 32-row group (2 / MT tiles)
    // Copies the stage `at` points at (none past the range; a commit group either way).
    auto issue = [&](const Cursor& at, uint32_t base) {
        if (at.j < n_stages) {
            const int k0 = at.s * ROW_BYTES;
            const uint8_t* w_stage = w_src + at.tile * tile_bytes + k0;
#pragma unroll
            for (int i = 0; i < MT * G; ++i) cp_async_cg16(base + w_dst[i], w_stage + i * w_step, 16);
#pragma unroll
            for (int i = 0; i < NT * G / 2; ++i) cp_async_ca16(base + x_dst[i], x_src[i] + k0, x_bytes[i]);
            if (scale_lane) {
                const uint8_t* src = s_src + ((at.tile * MT) >> 1) * sw_tile_bytes + at.s * G;
#pragma unroll
                for (int q = 0; q < GW; ++q) cp_async_ca4(base + s_dst + 4 * q, src + 4 * q, s_bytes);
            }
        }
        cp_async_commit();
    };
    // Thread (g, t)'s fragment word of block b in rows 16 mt + g, 16 mt + g + 8 and x's W_ROWS + 8 jt + g:
    // frag[b] plus those rows less g (the swizzle is the same in rows 4 apart).
    uint32_t frag[G];
#pragma unroll
    for (int b = 0; b < G; ++b) frag[b] = kept(static_cast<uint32_t>(word_offset<G>(g, b, t)));
    const uint32_t ring_addr = smem_addr(ring);
    Cursor ahead(range, warp);                              // the next stage to copy
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
        issue(ahead, ring_addr + i * L::STAGE_BYTES);
        ahead.advance(range, P);
    }

    int cur = 0;                                            // this stage's buffer; the one issued is the one before
    for (int st = warp; st < n_stages; st += P) {
        cp_async_wait<S - 2>();
        __syncwarp();
        issue(ahead, ring_addr + (cur == 0 ? S - 1 : cur - 1) * L::STAGE_BYTES);
        ahead.advance(range, P);
        const uint8_t* buf = ring + cur * L::STAGE_BYTES;
        cur = cur == S - 1 ? 0 : cur + 1;
        const uint32_t* sw4 = reinterpret_cast<const uint32_t*>(buf + L::SCALES_OFF);
        const uint32_t* sx4 = sw4 + 4;                      // [x row][GW]
        const int slot = st % L::R;
        mbar_wait(bars + 8 * (L::R + slot), ((st / L::R) & 1) ^ 1);
        // BI blocks at a time: all their operands first, then each block's MMAs and roundings, then
        // their terms and stores, so that the blocks' MMA chains can overlap and every shared-memory
        // load of the group precedes its stores
        constexpr int BI = NT * MT == 1 ? 4 : 2;
#pragma unroll
        for (int b0 = 0; b0 < G; b0 += BI) {
            uint32_t ah[BI][MT][2][4], al[BI][MT][2][4];    // [block][m-tile][step][reg]: rows g / g + 8
            uint32_t xh[BI][NT][4], xl[BI][NT][4];
#pragma unroll
            for (int bi = 0; bi < BI; ++bi) {
                const uint8_t* wg = buf + frag[b0 + bi];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    uint32_t h0[4], l0[4], h1[4], l1[4];
                    digits8(*reinterpret_cast<const uint2*>(wg + 16 * mt * ROW_BYTES), h0, l0);
                    digits8(*reinterpret_cast<const uint2*>(wg + (16 * mt + 8) * ROW_BYTES), h1, l1);
                    // step s: {p(2s) row g, p(2s) row g + 8, p(2s+1) row g, p(2s+1) row g + 8}
#pragma unroll
                    for (int s = 0; s < 2; ++s) {
                        ah[bi][mt][s][0] = h0[2 * s]; ah[bi][mt][s][1] = h1[2 * s];
                        ah[bi][mt][s][2] = h0[2 * s + 1]; ah[bi][mt][s][3] = h1[2 * s + 1];
                        al[bi][mt][s][0] = l0[2 * s]; al[bi][mt][s][1] = l1[2 * s];
                        al[bi][mt][s][2] = l0[2 * s + 1]; al[bi][mt][s][3] = l1[2 * s + 1];
                    }
                }
#pragma unroll
                for (int jt = 0; jt < NT; ++jt)
                    digits8(*reinterpret_cast<const uint2*>(wg + (L::W_ROWS + 8 * jt) * ROW_BYTES), xh[bi][jt], xl[bi][jt]);
            }
            // chained_dot's MMAs: mid = (wh.xl + wl.xh) over both k16 steps in one chain of four,
            // mi = mid rounded to an integer, mf = mid - mi; H = wh.xh from mi and L = wl.xl from mf,
            // each a chain of two; every partial at most 24 significant bits, exact in the MMA's adds.
            const float zero[4] = {0.f, 0.f, 0.f, 0.f};
            float hh[BI][MT * NT][4], ll[BI][MT * NT][4];
#pragma unroll
            for (int bi = 0; bi < BI; ++bi)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int jt = 0; jt < NT; ++jt) {
                        const uint32_t bh0[2] = {xh[bi][jt][0], xh[bi][jt][1]}, bh1[2] = {xh[bi][jt][2], xh[bi][jt][3]};
                        const uint32_t bl0[2] = {xl[bi][jt][0], xl[bi][jt][1]}, bl1[2] = {xl[bi][jt][2], xl[bi][jt][3]};
                        const int j = mt * NT + jt;
                        float mid[4], mi[4], mf[4];
                        mma16816(mid, ah[bi][mt][0], bl0, zero);
                        mma16816(mid, ah[bi][mt][1], bl1, mid);
                        mma16816(mid, al[bi][mt][0], bh0, mid);
                        mma16816(mid, al[bi][mt][1], bh1, mid);
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            mi[i] = __fsub_rn(__fadd_rn(mid[i], 12582912.0f), 12582912.0f);
                            mf[i] = __fsub_rn(mid[i], mi[i]);
                        }
                        mma16816(hh[bi][j], ah[bi][mt][0], bh0, mi);
                        mma16816(hh[bi][j], ah[bi][mt][1], bh1, hh[bi][j]);
                        mma16816(ll[bi][j], al[bi][mt][0], bl0, mf);
                        mma16816(ll[bi][j], al[bi][mt][1], bl1, ll[bi][j]);
                    }
#pragma unroll
            for (int bi = 0; bi < BI; ++bi) {
                const int b = b0 + bi;
                const float swb = ue8m0((sw4[b / 4] >> (8 * (b % 4))) & 0xFFu);   // the tile's 32-row group
#pragma unroll
                for (int jt = 0; jt < NT; ++jt) {
                    float sxv[2];                                   // x rows 8 jt + 2 t + i
#pragma unroll
                    for (int i = 0; i < 2; ++i)
                        sxv[i] = ue8m0((sx4[(8 * jt + 2 * t + i) * GW + b / 4] >> (8 * (b % 4))) & 0xFFu);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const int j = mt * NT + jt;
                        float4 term;
                        float* tp = reinterpret_cast<float*>(&term);
#pragma unroll
                        for (int i = 0; i < 4; ++i)
                            tp[i] = __fmul_rn(__fmul_rn(__fadd_rn(hh[bi][j][i], ll[bi][j][i]), sxv[i & 1]), swb);
                        terms[((slot * G + b) * MT * NT + j) * 32 + lane] = term;
                    }
                }
            }
        }
        mbar_arrive(bars + 8 * slot);
    }
    cp_async_wait<0>();
}

}  // namespace

#define DSV41_KERNEL(NT, MT, P, S, G, NAME)                                                                       \
    extern "C" __global__ void __launch_bounds__((P + 1) * 32) NAME(                                                 \
        const uint8_t* x, const uint8_t* sx, const uint8_t* w, const uint8_t* sw, void* out, int m, int k,          \
        int ld_x, int ld_sx, int ld_w, int ld_sw, int ld_out, int out_fp32, int tiles, float* handoff, int* flags) { \
        exact_digits_mm<NT, MT, P, S, G>(x, sx, w, sw, out, m, k, ld_x, ld_sx, ld_w, ld_sw, ld_out, out_fp32, tiles, \
                                         handoff, flags);                                                          \
    }                                                                                                              \
    extern "C" __device__ int NAME##_smem = Layout<NT, MT, P, S, G>::SMEM;

// The kernels ops/cuda_exact_mm.py may launch (it reads this list): (n-tiles, warps, stages, blocks)
// with tiles of 16 weight rows, and with a fifth figure, m-tiles, tiles of 16 m-tiles rows.
#define DSV41_EXACT_DIGITS_MM(NT, P, S, G) DSV41_KERNEL(NT, 1, P, S, G, exact_digits_mm_nt##NT##_p##P##_s##S##_g##G)
#define DSV41_EXACT_DIGITS_MM_M(NT, P, S, G, MT) \
    DSV41_KERNEL(NT, MT, P, S, G, exact_digits_mm_nt##NT##_p##P##_s##S##_g##G##_m##MT)

DSV41_EXACT_DIGITS_MM(1, 4, 3, 4)
DSV41_EXACT_DIGITS_MM(1, 4, 4, 4)
DSV41_EXACT_DIGITS_MM(2, 4, 3, 4)
DSV41_EXACT_DIGITS_MM(2, 4, 4, 4)
DSV41_EXACT_DIGITS_MM_M(1, 4, 3, 4, 2)
DSV41_EXACT_DIGITS_MM_M(1, 4, 4, 4, 2)
DSV41_EXACT_DIGITS_MM_M(2, 4, 3, 4, 2)
