// The grouped expert GEMM for many rows an expert (prefill), 4-bit MLX-affine weights, on sm_90: wgmma with the
// weights dequantized into its register A operand and the tile's x as the shared-memory B operand. Compiled at run
// time by NVRTC (kernels/moe/wgmma.py, after w4_common.cuh's helpers); the Triton grouped GEMM in grouped.py does the
// same math and runs wherever this one does not apply.
//
// Why: at tens of rows an expert and more the work is tensor-core work. mma.sync (w4_mma.cu) re-reads x from shared
// memory for every 16 weight rows and keeps one program's warps in lockstep; here a warpgroup multiplies 64 weight
// rows by the whole tile of TN rows in one asynchronous wgmma a 16-k step, while its threads dequantize the next step.
//
// D^T [64 weight rows x TN tile rows] += W [64 x 16 k] X^T [16 k x TN]: m64nTNk16, W the register operand. Each warp
// of a warpgroup holds 16 of its rows in the m16n8k16 A layout: thread (g = lane / 4, t = lane % 4) holds rows g and
// g + 8 at k 2t, 2t + 1, 2t + 8, 2t + 9 of the step, in natural order here (B, x in shared memory, is in natural order):
// k 2t, 2t + 1 of a step are byte t of the row's word 2s; one byte permute puts its two codes in the two 16-bit halves,
// one LOP3 makes them 128 + q under the exponent (bf16; 1024 in fp16), two packed FMAs make s q + b (one rounding, as
// the reference). SWIGLU: a warp's rows g are gate rows and rows g + 8 the up rows of the same 8 output columns, so
// h = silu(gate) up is made in registers. Else a warp's 16 rows are 16 output columns.
//
// Program: WG warpgroups (MB x 64 weight rows each, MB wgmmas a step: 32 MB output columns with SWIGLU, else 64 MB;
// every weight row set a warpgroup adds is one more use of each x byte it copies), one tile of up to TN sorted rows
// of one expert (`grouped.tile_table`). Per 128-k chunk, cp.async brings STAGES - 1 chunks ahead: the tile's x in the
// wgmma's no-swizzle K-major layout (core matrices of 8 rows x 16 bytes: 8-row group i, 8-k piece p at (16 i + p) 128
// bytes; rows past the tile's end zero-filled, never read), the program's weight rows (64 bytes a row, 80 apart: no
// bank conflicts), their scales and biases. A chunk's 8 steps: dequantize step s, fence, issue its wgmma, commit, wait
// for step s - 1's (whose A registers are then free); the chunk ends waiting for all, so that the barrier at the next
// chunk frees its stage for the copies.
//
// Compile-time: SWIGLU, TN (tile rows: 64 or 128), WG, MB, GS (32 or 64), FP16, STAGES, MINB (programs an SM the
// registers are held to); WGMMA_STEP (wgmma.py writes it for TN: the asm names each of the TN / 2 accumulators).

#define KC 128
#define GPC (KC / GS)
#define THREADS (WG * 128)
#define WROWS (WG * MB * 64)            // weight rows a program
#define WCOLS (MB * (SWIGLU ? 32 : 64)) // output columns a warpgroup
#define WROW 80                         // bytes of a weight row's chunk in shared memory (64, and 16 of padding)
#define X_BYTES (TN * KC * 2)
#define W_BYTES (WROWS * WROW)
#define S_BYTES (2 * WROWS * GPC * 2)   // {scales, biases} x rows x groups a chunk
#define STAGE_BYTES (X_BYTES + W_BYTES + S_BYTES)
#define XPIECES (TN * 16 / THREADS)     // 16-byte pieces of x a thread copies a chunk
#define NACC (TN / 2)                   // accumulator registers a thread

typedef unsigned long long u64;

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// (no memory clobber: shared-memory loads of the next step may go before it; the A registers are held by `keep`,
// the accumulators by `hold` after the last wait)
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N)); }

// B's descriptor: no swizzle, K-major; the step's two 8-k core matrices 128 bytes apart (leading), 8-row groups 2048
// bytes apart (stride)
__device__ __forceinline__ u64 x_desc(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(2048 >> 4) << 32);
}

// the A registers live until the wgmma reading them is waited for
__device__ __forceinline__ void keep(const u32 (&r)[MB][4]) {
#pragma unroll
    for (int m = 0; m < MB; ++m) asm volatile("" ::"r"(r[m][0]), "r"(r[m][1]), "r"(r[m][2]), "r"(r[m][3]));
}

// the accumulators read only after the wait before it (the wgmmas write them asynchronously)
__device__ __forceinline__ void hold(float (&d)[MB][NACC]) {
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
        for (int i = 0; i < NACC; ++i) asm volatile("" : "+f"(d[m][i])::"memory");
}

WGMMA_STEP

// s q + b of the two codes of byte t of word v (`sel`: byte t of v and of v >> 4 into the two halves' low bytes)
__device__ __forceinline__ u32 dequant_byte(u32 v, u32 sel, u32 s2, u32 b2, u32 mask, u32 magic) {
    return fma2(fma2(and_or(prmt(v, v >> 4, sel), mask, magic), ONE, NEG_MAGIC), s2, b2);
}

// c[order[r]] for the sorted rows r of each tile (expert e, first row): a[order[r] / a_div] @ W[e]^T over columns
// [0, N), or with SWIGLU silu(a Wg^T) * (a Wu^T), Wu the N rows below Wg.
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
moe_w4_wgmma(const u16* __restrict__ a, const u32* __restrict__ w, const u16* __restrict__ s,
             const u16* __restrict__ b, u16* __restrict__ c, const int* __restrict__ order,
             const int* __restrict__ tile_expert, const int* __restrict__ tile_row, const int* __restrict__ offsets,
             int N, int K, int E_total, int a_div, i64 stride_am, i64 stride_we, i64 stride_wn, i64 stride_se,
             i64 stride_sn, i64 stride_cm) {
    extern __shared__ __align__(128) unsigned char smem[];
    grid_wait();
    const int e = tile_expert[blockIdx.y];
    if (e >= E_total) return;  // the grid is an upper bound on the tile count (the whole program: no barrier missed)
    const int row0 = tile_row[blockIdx.y], row_end = offsets[e + 1];
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const u32* W = w + e * stride_we;
    const u16* S = s + e * stride_se;
    const u16* B = b + e * stride_se;

    // program weight row pr: warpgroup pr / (64 MB), its wgmma m = (pr / 64) % MB, warp (pr / 16) % 4, fragment row
    // pr % 16 (g, or g + 8 from 8 on); its output column (a gate and an up row with SWIGLU)
    auto memory_row = [&](int pr) -> i64 {
        const int r16 = pr & 15, wq = (pr >> 4) & 3, m = (pr >> 6) % MB, wgi = pr / (64 * MB);
        const int wcol = (blockIdx.x * WG + wgi) * WCOLS;
#if SWIGLU
        const int col = wcol + 32 * m + 8 * wq + (r16 & 7);
        return r16 < 8 ? col : N + col;
#else
        return wcol + 64 * m + 16 * wq + r16;
#endif
    };
    // what this thread copies a chunk: 2 MB 16-byte quarters of weight rows, the scales or biases of MB rows,
    // XPIECES pieces of x (8-row group (tid / 128) + (THREADS / 128) i, its row tid % 8, 8-k piece (tid / 8) % 16)
    const u32* wsrc[2 * MB];
    u32 wdst[2 * MB];
#pragma unroll
    for (int i = 0; i < 2 * MB; ++i) {
        const int p = tid + i * THREADS;
        wsrc[i] = W + memory_row(p >> 2) * stride_wn + 4 * (p & 3);
        wdst[i] = X_BYTES + (p >> 2) * WROW + 16 * (p & 3);
    }
    const u16* ssrc[MB];
    u32 sdst[MB];
#pragma unroll
    for (int i = 0; i < MB; ++i) {
        const int p = tid + i * THREADS;
        ssrc[i] = ((p & 1) ? B : S) + memory_row(p >> 1) * stride_sn;
        sdst[i] = X_BYTES + W_BYTES + ((p & 1) * WROWS + (p >> 1)) * GPC * 2;
    }
    const u16* xsrc[XPIECES];
    u32 xbytes[XPIECES];
#pragma unroll
    for (int i = 0; i < XPIECES; ++i) {
        const int n = ((tid >> 7) + (THREADS / 128) * i) * 8 + (tid & 7);
        const bool ok = row0 + n < row_end;
        xsrc[i] = a + (i64)(order[ok ? row0 + n : row0] / a_div) * stride_am + 8 * ((tid >> 3) & 15);
        xbytes[i] = ok ? 16 : 0;
    }
    const u32 base = smem_addr(smem);
    const int nc = K / KC;
    auto load = [&](int ch, int st) {
        const u32 sb = base + st * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < 2 * MB; ++i) cp16(sb + wdst[i], wsrc[i] + ch * (KC / 8), 16);
#pragma unroll
        for (int i = 0; i < MB; ++i) cp_scales(sb + sdst[i], ssrc[i] + ch * GPC);
#pragma unroll
        for (int i = 0; i < XPIECES; ++i)  // (8-row group j at j * 2048: this thread's piece at j * 2048 + tid % 128 * 16)
            cp16(sb + ((tid >> 7) + (THREADS / 128) * i) * 2048 + (tid & 127) * 16, xsrc[i] + ch * KC, xbytes[i]);
    };

    float d[MB][NACC];
#pragma unroll
    for (int m = 0; m < MB; ++m)
#pragma unroll
        for (int i = 0; i < NACC; ++i) d[m][i] = 0.f;
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < nc) load(i, i);
        cp_commit();
    }
    const int r0 = wg * 64 * MB + warp * 16 + g;  // this thread's fragment row g of wgmma 0 in the program's
    const u32 sel = t | (t << 4) | ((4 + t) << 8) | ((4 + t) << 12);
    u32 mask = 0x000F000Fu, magic = MAGIC;
    asm volatile("" : "+r"(mask), "+r"(magic));  // kept in registers: LOP3 takes one immediate
    for (int ch = 0; ch < nc; ++ch) {
        cp_wait_ahead();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the copies, seen by the wgmma's reads
        __syncthreads();  // every copy of chunk ch landed; every wgmma of chunk ch - 1 done (waited below)
        {
            const int nx = ch + STAGES - 1;
            if (nx < nc) load(nx, nx % STAGES);
            cp_commit();
        }
        const u32 st = (ch % STAGES) * STAGE_BYTES;
        const unsigned char* ws = smem + st + X_BYTES;
        const u16* sc = reinterpret_cast<const u16*>(smem + st + X_BYTES + W_BYTES);
        u32 A[2][MB][4];
        // the raw words and scales of a step: loaded a step ahead, before the wait (the A registers they become are
        // free only after it)
        uint2 va[MB], vb[MB];
        u32 sa[MB], sbv[MB], ba[MB], bb[MB];
        auto fetch = [&](int step) {
            const int grp = step * 16 / GS;
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                const int ra = r0 + 64 * m, rb = ra + 8;
                sa[m] = sc[ra * GPC + grp], sbv[m] = sc[rb * GPC + grp];
                ba[m] = sc[(WROWS + ra) * GPC + grp], bb[m] = sc[(WROWS + rb) * GPC + grp];
                va[m] = *reinterpret_cast<const uint2*>(ws + ra * WROW + 8 * step);
                vb[m] = *reinterpret_cast<const uint2*>(ws + rb * WROW + 8 * step);
            }
        };
        fetch(0);
#pragma unroll
        for (int step = 0; step < 8; ++step) {
#pragma unroll
            for (int m = 0; m < MB; ++m) {
                const u32 s2a = sa[m] | (sa[m] << 16), b2a = ba[m] | (ba[m] << 16);
                const u32 s2b = sbv[m] | (sbv[m] << 16), b2b = bb[m] | (bb[m] << 16);
                u32(&r)[4] = A[step & 1][m];
                r[0] = dequant_byte(va[m].x, sel, s2a, b2a, mask, magic);  // row g, k 2t, 2t + 1
                r[1] = dequant_byte(vb[m].x, sel, s2b, b2b, mask, magic);  // row g + 8
                r[2] = dequant_byte(va[m].y, sel, s2a, b2a, mask, magic);  // row g, k 2t + 8, 2t + 9
                r[3] = dequant_byte(vb[m].y, sel, s2b, b2b, mask, magic);
            }
            wgmma_fence();
#pragma unroll
            for (int m = 0; m < MB; ++m) wgmma_step(d[m], A[step & 1][m], x_desc(base + st + step * 256));
            wgmma_commit();
            if (step < 7) fetch(step + 1);
            if (step > 0) {
                wgmma_wait<1>();  // step - 1's wgmmas done: their A registers are free
                keep(A[(step - 1) & 1]);
            }
        }
        wgmma_wait<0>();
        keep(A[1]);
        hold(d);
    }

    // d[m][4j + q]: weight row g of wgmma m, tile row 8j + 2t + q; d[m][4j + 2 + q]: weight row g + 8
#pragma unroll
    for (int j = 0; j < TN / 8; ++j)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int r = row0 + 8 * j + 2 * t + q;
            if (r < row_end) {
                const i64 at = (i64)order[r] * stride_cm;
#pragma unroll
                for (int m = 0; m < MB; ++m) {
                    const int wcol = (blockIdx.x * WG + wg) * WCOLS;
#if SWIGLU
                    const float gv = d[m][4 * j + q];
                    const int col = wcol + 32 * m + 8 * warp + g;
                    c[at + col] = to_half(gv / (1.f + __expf(-gv)) * d[m][4 * j + 2 + q]);
#else
                    const int col = wcol + 64 * m + 16 * warp + g;
                    c[at + col] = to_half(d[m][4 * j + q]);
                    c[at + col + 8] = to_half(d[m][4 * j + 2 + q]);
#endif
                }
            }
        }
}
