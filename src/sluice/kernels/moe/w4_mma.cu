// The grouped expert GEMM for few rows an expert, 4-bit MLX-affine weights, in CUDA C for NVRTC
// (kernels/moe/mma.py compiles it at run time; the Triton grouped GEMM in grouped.py does the same math and is the
// path under the interpreter, in CI and wherever this one does not apply).
//
// Why not Triton: at 1-32 rows an expert the work is reading the expert's 4-bit words once and turning them into
// tensor-core operands. Triton dequantizes a tile in its own layout and moves it into the MMA operand layout
// through shared memory; here each thread loads exactly the words its mma.sync A fragments need, in MLX's own
// layout (no repacking at load), and dequantizes them straight into those registers.
//
// C^T [16 weight rows x 8 rows of the tile] += W [16 x 16 k] X^T [16 k x 8]: m16n8k16, W the A operand. With
// g = lane / 4 and t = lane % 4, the A fragment of thread (g, t) holds rows g and g + 8 at logical k 2t, 2t + 1,
// 2t + 8, 2t + 9, and the B fragment holds the same logical k of tile row g. Which physical k a logical k stands for
// is free as long as A and B agree, so thread t takes physical k 32t .. 32t + 31 of each 128-k chunk: its four
// consecutive words of a row (one 16-byte load). MLX packs element e of a word at bits 4e; (w >> 4p) & 0x000F000F
// puts elements p and p + 4 in the two 16-bit halves, and OR-ing the exponent of 128 (bf16; 1024 for fp16) makes
// them 128 + q exactly: one shift and one LOP3 a pair, then q = v - 128 and s q + b, two packed FMAs (the same single
// rounding of s q + b as the reference). Step s of the chunk's eight takes word s / 2 of the thread's four, pairs
// p = 2 (s % 2) and p + 1; the B registers are built to match with one byte permute each from x held in order.
//
// Program: (16 WARPS weight rows, tile). A tile is up to TM = 8 NB sorted rows of one expert (`grouped.tile_table`);
// each warp owns 16 output columns (SWIGLU: 16 gate rows and the 16 up rows N below them, h = silu(g) u in the
// epilogue). Per 128-k chunk, cp.async brings STAGES - 1 chunks ahead: each thread its own weight words (read back
// only by itself), a lane per (row, scales or biases) the chunk's groups, and the block together the tile's x chunk
// (shared by the warps; rows past the tile's end zero-filled, never read from memory).
//
// DENSE: one weight [N, K] (a dense projection), rows 0..M-1 of a in tiles of TM (blockIdx.x: neighbouring programs
// read the same weights), no table. Each warp reads MT row sets of 16 weight rows against every x chunk it loads into
// registers: x is read from shared memory once for MT x 16 weight rows (at 64 rows of x and MT = 1 that traffic is
// 16x the weights' and bounds the kernel). A split (blockIdx.z) takes k_chunks chunks of K and writes fp32 partials
// [splits, M, N] to ws; the split that arrives last at a (tile, column block) (a counter in `counters`, set back to 0
// by it) sums them into c: one launch, no second pass. The last column block may be part of a program (its warps
// past N idle).
//
// Compile-time: SWIGLU, NB (tile rows / 8), GS (32 or 64), FP16 (x, scales and the output fp16, else bf16), DENSE, MT
// (1 unless DENSE), WARPS, STAGES.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct __align__(16) U4 { u32 x, y, z, w; };

#define KC 128                           // k a chunk
#define ROWSETS (SWIGLU ? 2 : MT)        // 16-row sets a warp reads: gate (and up), or MT of a dense weight
#define COLS (16 * (SWIGLU ? 1 : MT))    // output columns a warp
#define GPC (KC / GS)                    // quantization groups a chunk
#define TM (8 * NB)                      // rows a tile
#define XROW 320                         // bytes of a tile row's chunk in shared memory (256 and 64 of padding)
#define W_BYTES (ROWSETS * 2 * 32 * 16)  // a warp's words a stage: row sets x (rows g, g + 8) x lanes x 16 B
#define S_BYTES (ROWSETS * 2 * 16 * GPC * 2)  // its scales and biases: row sets x {s, b} x 16 rows x GPC x 2 B
#define X_BYTES (TM * XROW)
#define XCOPY_ROWS (WARPS * 2)           // tile rows of x the block copies a round (16 pieces of 16 bytes a row)
#define XROUNDS ((TM + XCOPY_ROWS - 1) / XCOPY_ROWS)
#define WARP_BYTES (W_BYTES + S_BYTES)
#define STAGE_BYTES (X_BYTES + WARPS * WARP_BYTES)

#if FP16
#define MAGIC 0x64006400u      // 1024, 1024
#define NEG_MAGIC 0xE400E400u  // -1024, -1024
#define ONE 0x3C003C00u
#define MMA_TYPE "f16"
#else
#define MAGIC 0x43004300u      // 128, 128
#define NEG_MAGIC 0xC300C300u  // -128, -128
#define ONE 0x3F803F80u
#define MMA_TYPE "bf16"
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes, or zeros where src_bytes is 0 (nothing read)
__device__ __forceinline__ void cp16(u32 dst, const void* src, u32 src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_scales(u32 dst, const void* src) {
#if GS == 64
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src));
#else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src));
#endif
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }

// the oldest of the STAGES - 1 chunks in flight has landed
__device__ __forceinline__ void cp_wait_ahead() { asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory"); }

__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

__device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
    u32 d;
#if FP16
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
#endif
    return d;
}

// (a & b) | c in one LOP3 (written in C, the compiler makes two: one immediate an instruction)
__device__ __forceinline__ u32 and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// s q + b of elements p and p + 4 of a word shifted right by 4p (mask and magic: registers)
__device__ __forceinline__ u32 dequant(u32 shifted, u32 s2, u32 b2, u32 mask, u32 magic) {
    return fma2(fma2(and_or(shifted, mask, magic), ONE, NEG_MAGIC), s2, b2);
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_TYPE "." MMA_TYPE ".f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u16 to_half(float x) {
    u16 r;
#if FP16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
#endif
    return r;
}

__device__ __forceinline__ u32 word_of(const U4& v, int j) { return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w; }

// c[order[r], n] for the sorted rows r of each tile (expert e, first row) and columns n in [0, N): a[order[r] / a_div]
// @ W[e, n]^T, or with SWIGLU silu(a Wg[n]^T) * (a Wu[n]^T), Wu the row N below. Experts e >= E are extra ones
// (a shared expert's slots): the [N or 2N, K] block x_words packed words (x_groups groups) apart from xw's first.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
moe_w4_mma(const u16* __restrict__ a, const u32* __restrict__ w, const u16* __restrict__ s, const u16* __restrict__ b,
           const u32* __restrict__ xw, const u16* __restrict__ xs, const u16* __restrict__ xb, u16* __restrict__ c,
           const int* __restrict__ order, const int* __restrict__ tile_expert, const int* __restrict__ tile_row,
           const int* __restrict__ offsets, float* __restrict__ ws, int* __restrict__ counters, int N, int K, int E,
           int E_total, int a_div, int M, int k_chunks, i64 stride_am, i64 stride_we, i64 stride_wn, i64 stride_se,
           i64 stride_sn, i64 x_words, i64 x_groups, i64 x_wn, i64 x_sn, i64 stride_cm) {
    extern __shared__ __align__(16) unsigned char smem[];
    grid_wait();
#if DENSE
    const int tile = blockIdx.x, cblock = blockIdx.y;
    const int e = 0, row0 = tile * TM, row_end = M;
#else
    const int tile = blockIdx.y, cblock = blockIdx.x;
    const int e = tile_expert[tile];
    if (e >= E_total) return;  // the grid is an upper bound on the tile count (the whole program: no barrier missed)
    const int row0 = tile_row[tile];
    const int row_end = offsets[e + 1];
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n0 = (cblock * WARPS + warp) * COLS;
    const i64 set_rows = SWIGLU ? N : 16;  // rows from one row set to the next
#if DENSE
    // the last program's warps past N idle (N a multiple of COLS, `dense_plan`: a warp's columns are all in or all
    // out); they copy rows 0.. (every warp takes part in the barriers)
    const bool live = n0 < N;
    const int nl = live ? n0 : 0;
#else
    const int nl = n0;
#endif

    const u32* W;
    const u16* S;
    const u16* B;
    i64 wn, sn;
    if (e < E) {
        W = w + e * stride_we, S = s + e * stride_se, B = b + e * stride_se, wn = stride_wn, sn = stride_sn;
    } else {
        const i64 i = e - E;
        W = xw + i * x_words, S = xs + i * x_groups, B = xb + i * x_groups, wn = x_wn, sn = x_sn;
    }

    // what this thread copies each chunk: its words of rows g, g + 8 (of each row set), one (row, scales or biases)
    // of the warp's, and NB 16-byte pieces of the tile's x
    const u32* wsrc[ROWSETS * 2];
#pragma unroll
    for (int i = 0; i < ROWSETS * 2; ++i) wsrc[i] = W + (nl + g + 8 * (i & 1) + (i >> 1) * set_rows) * wn + 4 * t;
    const u16* ssrc[ROWSETS];
#pragma unroll
    for (int r = 0; r < ROWSETS; ++r) ssrc[r] = ((t & 1) ? B : S) + (nl + g + 8 * (t >> 1) + r * set_rows) * sn;
    const u16* xsrc[XROUNDS];
    u32 xbytes[XROUNDS], xdst[XROUNDS];
    bool xcopy[XROUNDS];
    const int piece = tid & 15;
#pragma unroll
    for (int r = 0; r < XROUNDS; ++r) {
        const int j = (tid >> 4) + XCOPY_ROWS * r;
        xcopy[r] = j < TM;
        const bool ok = xcopy[r] && row0 + j < row_end;
#if DENSE
        const int slot = ok ? row0 + j : row0;
#else
        const int slot = order[ok ? row0 + j : row0];
#endif
        xsrc[r] = a + (i64)(slot / a_div) * stride_am + piece * 8;
        xbytes[r] = ok ? 16 : 0;
        // thread (g, t) reads its i-th piece (k 32t + 8i ..) at i * 64 + t * 16: piece 4t + i
        xdst[r] = j * XROW + (piece & 3) * 64 + (piece >> 2) * 16;
    }
    const u32 base = smem_addr(smem);
    const u32 wreg = X_BYTES + warp * WARP_BYTES;

    const int c0 = blockIdx.z * k_chunks;  // this split's first chunk
    const int nc = min(K / KC - c0, k_chunks);
    auto load = [&](int chunk, int st) {
        const int ch = c0 + chunk;
        const u32 sb = base + st * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < ROWSETS * 2; ++i) cp16(sb + wreg + (i * 32 + lane) * 16, wsrc[i] + ch * (KC / 8), 16);
#pragma unroll
        for (int r = 0; r < ROWSETS; ++r)
            cp_scales(sb + wreg + W_BYTES + ((r * 2 + (t & 1)) * 16 + g + 8 * (t >> 1)) * GPC * 2, ssrc[r] + ch * GPC);
#pragma unroll
        for (int r = 0; r < XROUNDS; ++r)
            if (xcopy[r]) cp16(sb + xdst[r], xsrc[r] + ch * KC, xbytes[r]);
    };

    float acc[ROWSETS][NB][4];
#pragma unroll
    for (int r = 0; r < ROWSETS; ++r)
#pragma unroll
        for (int n = 0; n < NB; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.f;

#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < nc) load(i, i);
        cp_commit();
    }
    const int gi = (32 * t) / GS;  // the thread's group within a chunk
    u32 mask = 0x000F000Fu, magic = MAGIC;
    asm volatile("" : "+r"(mask), "+r"(magic));  // kept in registers: LOP3 takes one immediate
    for (int ch = 0; ch < nc; ++ch) {
        cp_wait_ahead();
        __syncthreads();  // every thread's copies of chunk ch have landed; every warp is done with chunk ch - 1
        {
            const int nx = ch + STAGES - 1;
            if (nx < nc) load(nx, nx % STAGES);
            cp_commit();
        }
        const unsigned char* st = smem + (ch % STAGES) * STAGE_BYTES;
        U4 wv[ROWSETS][2];
        u32 s2[ROWSETS][2], b2[ROWSETS][2];
        const unsigned char* wst = st + wreg;  // this warp's words and scales of the stage
        const u16* sc = reinterpret_cast<const u16*>(wst + W_BYTES);
#pragma unroll
        for (int r = 0; r < ROWSETS; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                wv[r][h] = *reinterpret_cast<const U4*>(wst + ((r * 2 + h) * 32 + lane) * 16);
                const u32 sv = sc[((r * 2) * 16 + g + 8 * h) * GPC + gi];
                const u32 bv = sc[((r * 2 + 1) * 16 + g + 8 * h) * GPC + gi];
                s2[r][h] = sv | (sv << 16);
                b2[r][h] = bv | (bv << 16);
            }
#pragma unroll
        for (int step = 0; step < 8; ++step) {
            const int j = step >> 1, hp = step & 1;  // word j of the thread's four; pairs 2hp and 2hp + 1
            u32 b0[NB], b1[NB];
#pragma unroll
            for (int n = 0; n < NB; ++n) {  // x[32t + 8j ..] of tile row 8n + g: its piece j, 4 words of pairs
                const U4 v = *reinterpret_cast<const U4*>(st + (8 * n + g) * XROW + j * 64 + t * 16);
                const u32 lo = hp ? v.y : v.x, hi = hp ? v.w : v.z;  // x[8j + 2hp, + 1], x[8j + 2hp + 4, + 5]
                b0[n] = prmt(lo, hi, 0x5410);  // x[8j + 2hp], x[8j + 2hp + 4]
                b1[n] = prmt(lo, hi, 0x7632);  // x[8j + 2hp + 1], x[8j + 2hp + 5]
            }
#pragma unroll
            for (int r = 0; r < ROWSETS; ++r) {
                const u32 w0 = word_of(wv[r][0], j), w1 = word_of(wv[r][1], j);
                const u32 a0 = dequant(w0 >> (8 * hp), s2[r][0], b2[r][0], mask, magic);
                const u32 a1 = dequant(w1 >> (8 * hp), s2[r][1], b2[r][1], mask, magic);
                const u32 a2 = dequant(w0 >> (8 * hp + 4), s2[r][0], b2[r][0], mask, magic);
                const u32 a3 = dequant(w1 >> (8 * hp + 4), s2[r][1], b2[r][1], mask, magic);
#pragma unroll
                for (int n = 0; n < NB; ++n) mma(acc[r][n], a0, a1, a2, a3, b0[n], b1[n]);
            }
        }
    }

    // c fragment: acc[.][n][2h + q] is weight row g + 8h, tile row 8n + 2t + q
#if DENSE
    const bool split = gridDim.z > 1;
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int r = row0 + 8 * n + 2 * t + q;
            if (r < row_end && live) {
#pragma unroll
                for (int i = 0; i < ROWSETS; ++i)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const int col = n0 + 16 * i + g + 8 * h;
                        if (split)
                            ws[((i64)blockIdx.z * M + r) * N + col] = acc[i][n][2 * h + q];
                        else
                            c[(i64)r * stride_cm + col] = to_half(acc[i][n][2 * h + q]);
                    }
            }
        }
    if (split) {  // the last split of this (tile, column block) to arrive sums the partials
        __shared__ int last;
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(counters + blockIdx.y * gridDim.x + blockIdx.x, 1) == (int)gridDim.z - 1;
        __syncthreads();
        if (last) {
            __threadfence();
            constexpr int Q = WARPS * COLS / 4;  // 4-column pieces a row of the program's columns
            const int col0 = cblock * WARPS * COLS, rows = min(TM, row_end - row0);
            for (int p = tid; p < rows * Q; p += WARPS * 32) {
                const int r = row0 + p / Q, col = col0 + 4 * (p % Q);
                if (col >= N) continue;
                float4 sum = __ldcg(reinterpret_cast<const float4*>(ws + (i64)r * N + col));
                for (int z = 1; z < (int)gridDim.z; ++z) {
                    const float4 v = __ldcg(reinterpret_cast<const float4*>(ws + ((i64)z * M + r) * N + col));
                    sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
                }
                u16* out = c + (i64)r * stride_cm + col;
                out[0] = to_half(sum.x), out[1] = to_half(sum.y), out[2] = to_half(sum.z), out[3] = to_half(sum.w);
            }
            if (tid == 0) counters[blockIdx.y * gridDim.x + blockIdx.x] = 0;  // ready for the next launch
        }
    }
#else
#pragma unroll
    for (int n = 0; n < NB; ++n)
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int r = row0 + 8 * n + 2 * t + q;
            if (r < row_end) {
                const i64 at = (i64)order[r] * stride_cm + n0 + g;
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    float v = acc[0][n][2 * h + q];
#if SWIGLU
                    v = v / (1.f + __expf(-v)) * acc[ROWSETS - 1][n][2 * h + q];
#endif
                    c[at + 8 * h] = to_half(v);
                }
            }
        }
#endif
}
