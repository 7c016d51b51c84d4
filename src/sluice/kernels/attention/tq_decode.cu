// TurboQuant decode attention, the split kernel, in CUDA C for NVRTC (kernels/attention/cuda.py compiles it at
// run time; the Triton kernel in triton.py does the same math and is the one the interpreter tests).
//
// Why not Triton: the loop is bound by the instructions that turn 4-bit codes into int8 levels and by moving
// them into tensor-core operand registers. Here each thread loads exactly the code words its mma.sync operands
// need, decodes them with byte permutes straight into those registers and never converts a layout.
//
// Program: (sequence x KV head, split), W warps; each warp streams its own 32-position blocks (cp.async into
// shared memory, STAGES deep) with its own online softmax, and the warps merge in shared memory at the end into
// the split's partial (unnormalised output, max, sum) in the Triton kernel's layout, so the same merge kernel
// finishes the job; with `unrotate` the partial is rotated back out of the codec's domain first (the merge is
// linear). Splits >= n_coded take the newest positions from the exact ring (staged in shared memory, fp32 FMAs).
//
// Per block, with g = lane / 4 and t = lane % 4 (the mma fragment coordinates):
//   scores S^T [32 positions x 8 heads] = K [positions x D] q^T: m16n8k32 int8, K as the A operand (rows are
//     positions g, g + 8, 16 + g, 24 + g; the coordinates of the k slots are whatever the code words hold: q
//     is packed to match once per program);
//   P V as O^T [D x 8 heads] += V^T [D x 32 positions] P^T: V as the A operand (rows are coordinates), the
//     probabilities in 16 bits (P = 65535 * 2^(x - m) * vscale / vscale_max) as two u8 B operands (high and low
//     byte: two mma's, two int32 sums), moved there from the score layout through shared memory; the int32 sums
//     are kept across blocks until a head's max or vscale_max moves, then added to fp32 sums in shared memory.
// Codes to levels: code k < 8 has a negative level L(k), k >= 8 a positive one. prmt's sign-replicate mode
// turns a selector nibble with bit 3 set into 0x00 / 0xFF, so for tables TA[j] = L(j) - 1 (all negative) and
// TB[j] = L(8 + j) (all positive): prmt(TA, code) + prmt(TB, code ^ 8) = L(k) - 1 for every k. The two parts
// go to two mma's on the same accumulator (the sum is never formed) and the -1 is added back: sum q for the
// scores (the accumulator starts there), sum P for the values (an mma of P with a row of ones).
//
// Compile-time: D (64, 128, 256), G (query heads per KV head, <= 8), QP (q as 1 or 2 int8 parts: 7 or 15
// bits), W (warps), STAGES, RING_BF16 (the ring's dtype: bf16, else fp32), POS64 (positions int64), ROWS (0: query
// row b reads the cache tensors' row b; 32 or 64: row rows[b], rows int32 or int64, the cache tensors a pool), PAGED
// (the codes and scales are blocks of `cap` positions, a multiple of BLK: a row's position j sits in block
// tab[row, j / cap] at slot j % cap; the ring stays one per row; no window).

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct __align__(16) U4 { u32 x, y, z, w; };

#define DH (D / 2)            // code bytes per vector
#define WPT (D / 32)          // key code words per thread per position (k steps of 32 coordinates)
#define BLK 32                // positions per block
#define CODE_BYTES (BLK * DH) // key (and value) code bytes per block
#define STAGE_BYTES (2 * CODE_BYTES + 2 * BLK * 4)
#define NJJ (D / 64)          // value coordinate groups: 4 low-half coordinates (and their high partners) a thread
#define LN2 0.6931471805599453f
#define INF __int_as_float(0x7f800000)
#define FLUSH_BLOCKS 512      // int32 sums stay below 2^30

#if RING_BF16
typedef u16 ring_t;
__device__ __forceinline__ float ring_f(ring_t x) { return __uint_as_float(((u32)x) << 16); }
#else
typedef float ring_t;
__device__ __forceinline__ float ring_f(ring_t x) { return x; }
#endif

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 s) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
    return d;
}

__device__ __forceinline__ void mma_s8s8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_s8u8(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// the oldest of the STAGES - 1 blocks in flight has landed
__device__ __forceinline__ void cp_wait_ahead() {
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
}

// programmatic dependent launch (sm_90): this grid's programs may be placed while the kernel before still runs;
// they wait here, before reading anything, for it to finish and its writes to be visible. (Issuing the first blocks
// before the wait, legal for codes written two launches back, measured no faster: docs/PERF.md)
__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ int rni(float x) {
    int y;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(y) : "f"(x));
    return y;
}

// The two halves of a code word's levels: nibbles 0-3 and 4-7 of w, each as 4 bytes (A part + B part = L - 1).
struct Lv { u32 a_lo, b_lo, a_hi, b_hi; };

__device__ __forceinline__ Lv levels(u32 w, u32 ta0, u32 ta1, u32 tb0, u32 tb1) {
    u32 x = w ^ 0x88888888u;
    Lv r;
    r.a_lo = prmt(ta0, ta1, w);
    r.b_lo = prmt(tb0, tb1, x);
    r.a_hi = prmt(ta0, ta1, w >> 16);
    r.b_hi = prmt(tb0, tb1, x >> 16);
    return r;
}

// A value word holds four positions' bytes (low nibble: coordinate c, high: c + D/2); its levels regrouped as
// (c at the four positions) and (c + D/2 at them), each as A and B parts.
__device__ __forceinline__ Lv value_levels(u32 w, u32 ta0, u32 ta1, u32 tb0, u32 tb1) {
    Lv l = levels(w, ta0, ta1, tb0, tb1);
    Lv r;
    r.a_lo = prmt(l.a_lo, l.a_hi, 0x6420);
    r.a_hi = prmt(l.a_lo, l.a_hi, 0x7531);
    r.b_lo = prmt(l.b_lo, l.b_hi, 0x6420);
    r.b_hi = prmt(l.b_lo, l.b_hi, 0x7531);
    return r;
}

// output coordinate of accumulator element (jj, tile tt, register e) of lane group g (see the P V tiles)
__device__ __forceinline__ int out_coord(int jj, int tt, int e, int g) {
    return 4 * (8 * jj + g) + 2 * (tt & 1) + (e >> 1) + (tt >> 1) * DH;
}

// R^T o = signs * (H o) / sqrt(D) for N rows whose coordinates sit at lane + 32 i (i < D / 32) of a warp: a
// Walsh-Hadamard transform in registers (the coordinate bits of i) and shuffles (those of the lane); the rows side
// by side, so that their latencies overlap
template <int N>
__device__ __forceinline__ void unrotate_rows(float (&o)[N][D / 32], const float* Sg, int lane) {
    constexpr int VPL = D / 32;
#pragma unroll
    for (int len = 1; len < VPL; len <<= 1)
#pragma unroll
        for (int i = 0; i < VPL; i++)
            if (!(i & len))
#pragma unroll
                for (int k = 0; k < N; k++) {
                    const float a = o[k][i], c = o[k][i + len];
                    o[k][i] = a + c;
                    o[k][i + len] = a - c;
                }
#pragma unroll
    for (int bit = 1; bit < 32; bit <<= 1) {
        const float sgn = (lane & bit) ? -1.f : 1.f;  // the upper of a pair: partner - own
#pragma unroll
        for (int i = 0; i < VPL; i++)
#pragma unroll
            for (int k = 0; k < N; k++) o[k][i] = fmaf(sgn, o[k][i], __shfl_xor_sync(0xffffffffu, o[k][i], bit));
    }
    const float norm = rsqrtf((float)D);
#pragma unroll
    for (int i = 0; i < VPL; i++) {
        const float f = Sg[lane + 32 * i] * norm;
#pragma unroll
        for (int k = 0; k < N; k++) o[k][i] *= f;
    }
}

// one tile of P V: the levels (one part) times P's high and its low bytes
__device__ __forceinline__ void pv_mma(int* ch, int* cl, u32 a0, u32 a1, u32 a2, u32 a3, u32 ph0, u32 ph1, u32 pl0,
                                       u32 pl1) {
    mma_s8u8(ch, a0, a1, a2, a3, ph0, ph1);
    mma_s8u8(cl, a0, a1, a2, a3, pl0, pl1);
}

// the int32 P V sums (+ sum P: the levels come out as L - 1) into this thread's fp32 sums in shared memory, scaled
// by u and by the factors of heads 2t (a0) and 2t + 1 (a1); the int sums restart at 0
__device__ __forceinline__ void flush(float* Ow, int (&ch)[NJJ][4][4], int (&cl)[NJJ][4][4], int* psh, int* psl,
                                      float u, float a0, float a1, int g, int t, bool& wrote) {
#pragma unroll
    for (int jj = 0; jj < NJJ; jj++)
#pragma unroll
        for (int tt = 0; tt < 4; tt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                if (2 * t + (e & 1) < G) {  // (the mma's 8 head columns: those past G are padding)
                    float* o = Ow + (2 * t + (e & 1)) * D + out_coord(jj, tt, e, g);
                    const float sum = (float)(ch[jj][tt][e] + psh[e]) * 256.f + (float)(cl[jj][tt][e] + psl[e]);
                    *o = ((wrote ? *o : 0.f) + sum * u) * ((e & 1) ? a1 : a0);
                }
                ch[jj][tt][e] = 0;
                cl[jj][tt][e] = 0;
            }
#pragma unroll
    for (int e = 0; e < 4; e++) psh[e] = psl[e] = 0;
    wrote = true;
}

extern "C" __global__ void __launch_bounds__(W * 32) tq_decode_split(
    const float* __restrict__ q, const unsigned char* __restrict__ kc, const unsigned char* __restrict__ vc,
    const float* __restrict__ ks, const float* __restrict__ vs, const ring_t* __restrict__ kr,
    const ring_t* __restrict__ vr, const void* __restrict__ pos_ptr, const void* __restrict__ rows_ptr,
    float* __restrict__ op, float* __restrict__ ml, const float* __restrict__ signs, float scale_log2,
    float level_step, int Hkv, int cap, int per_split, int n_coded, int n_splits, int recent, int window, int ring,
    int unrotate, int BG,
    i64 sqb, i64 sqh, i64 skb, i64 skh, i64 svb, i64 svh, i64 ssb, i64 ssh, i64 srb, i64 srh,
    u32 ta0, u32 ta1, u32 tb0, u32 tb1, const int* __restrict__ tab, i64 stab) {
    extern __shared__ __align__(16) unsigned char smem[];
    grid_wait();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int bh = blockIdx.x, split = blockIdx.y;
    const int b = bh / Hkv, h = bh % Hkv;
    const int part = bh * n_splits + split;
    const float* qrow = q + b * sqb + (i64)h * G * sqh;
    // the coded splits' q values, loaded first: their latency overlaps the position's
    constexpr int SPW = (WPT + W - 1) / W;  // q fragment steps a warp packs
    float4 qx[SPW][2];
#pragma unroll
    for (int j = 0; j < SPW; j++)
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int s = warp + j * W;
            qx[j][hf] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (split < n_coded && g < G && s < WPT)
                qx[j][hf] = *(const float4*)(qrow + g * sqh + hf * DH + 4 * (WPT * t + s));
        }
#if POS64
    const int p = (int)((const i64*)pos_ptr)[b];
#else
    const int p = ((const int*)pos_ptr)[b];
#endif
    // the cache tensors' row of query row b (q, the positions and the partials are indexed by b)
#if ROWS == 64
    const i64 row = ((const i64*)rows_ptr)[b];
#elif ROWS == 32
    const i64 row = ((const int*)rows_ptr)[b];
#else
    const i64 row = b;
#endif
    const int first = window > 0 ? max(p - window + 1, 0) : 0;
    const int coded_stop = p - recent + 1;  // positions below come from the codes

    // shared memory: the stages, each warp's fp32 output sums [G heads][D], its probabilities, (max, sum)
    float* Os = (float*)(smem + STAGES * W * STAGE_BYTES);                   // [W][G][D]
    unsigned char* Ps = smem + STAGES * W * STAGE_BYTES + W * G * D * 4 + warp * 512;  // [2][8 heads][32]
    float* ms = (float*)(smem + STAGES * W * STAGE_BYTES + W * G * D * 4 + W * 512);   // [W][8]
    float* ls = ms + W * 8;                                                          // [W][8]
    float* Ow = Os + warp * G * D;
    u32* Qs = (u32*)(ls + W * 8);                   // packed q fragments [part][step][register][lane]
    float* qmx = (float*)(Qs + 32 * QP * WPT * 2);  // [W][8]
    int* qsm = (int*)(qmx + W * 8);                 // [W][8][QP]
    float* Sg = (float*)(qsm + W * 8 * QP);          // the rotation's signs [D]
    if (unrotate && threadIdx.x < D / 4)  // for the epilogue: joins the first group of copies
        cp16(smem_addr(Sg) + threadIdx.x * 16, signs + 4 * threadIdx.x);

    float m0 = -INF, m1 = -INF, l0 = 0.f, l1 = 0.f;  // heads 2t, 2t + 1 (log2 units)

    if (split < n_coded) {
        const int s_start = first + split * per_split;
        const int s_stop = min(s_start + per_split, coded_stop);
        const int blk0 = s_start >= 0 ? s_start / BLK : 0;
        const int nblk = s_start < s_stop ? (s_stop + BLK - 1) / BLK - blk0 : 0;
        const int my_blocks = nblk > warp ? (nblk - warp + W - 1) / W : 0;
        unsigned char* stage0 = smem + warp * STAGES * STAGE_BYTES;
#if PAGED  // block 0's: each block's offset is added as it is issued
        const unsigned char* kbase = kc + h * skh;
        const unsigned char* vbase = vc + h * svh;
        const float* ksb = ks + h * ssh;
        const float* vsb = vs + h * ssh;
#else
        const unsigned char* kbase = kc + row * skb + h * skh;
        const unsigned char* vbase = vc + row * svb + h * svh;
        const float* ksb = ks + row * ssb + h * ssh;
        const float* vsb = vs + row * ssb + h * ssh;
#endif

        // issue block i of this warp into its stage. Lane offsets are fixed: chunk c = lane + 32 k of the keys
        // (row c / (D / 32)) lands k * 512 bytes after chunk `lane`'s (odd rows swap chunk pairs at D = 256);
        // the values' swizzle repeats every 4 k (2048 bytes)
        const int kl_row = lane / (D / 32), kl_cc = lane % (D / 32);
        const u32 k_off = kl_row * DH + ((kl_cc ^ (D == 256 ? (kl_row & 1) : 0)) * 16);
        u32 v_off[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int u = lane / (D / 8) + k * (256 / D), cv = lane % (D / 8);
            v_off[k] = u * (DH * 4) + ((cv ^ (2 * (u & 3))) * 16);
        }
        const float* sc_src = lane < 8 ? ksb + lane * 4 : vsb + (lane - 8) * 4;
        const u32 stage_addr = smem_addr(stage0);
        int issue_slot = blk0 * BLK + warp * BLK;  // slot of block i (ring: kept below cap)
        if (ring) issue_slot %= cap;
#if PAGED
        // issue_slot is the position (no ring): the block holding the next one to issue, looked up an issue
        // ahead, so the table read's latency hides behind a block's work
        const int* trow = tab + row * stab;
        i64 next_blk = my_blocks > 0 ? (i64)trow[issue_slot / cap] : 0;
#endif
        auto issue = [&](int i) {
            if (i < my_blocks) {
                const u32 sk = stage_addr + (i % STAGES) * STAGE_BYTES, sv = sk + CODE_BYTES;
#if PAGED
                const i64 pblk = next_blk;
                const int pslot = issue_slot % cap;
                const unsigned char* gk = kbase + pblk * skb + (i64)pslot * DH + lane * 16;
                const unsigned char* gv = vbase + pblk * svb + (i64)pslot * DH + lane * 16;  // (slot / 4) * 4 DH
                if (i + 1 < my_blocks) next_blk = trow[(issue_slot + W * BLK) / cap];
#else
                const unsigned char* gk = kbase + (i64)issue_slot * DH + lane * 16;
                const unsigned char* gv = vbase + (i64)issue_slot * DH + lane * 16;  // (slot / 4) * 4 DH
#endif
#pragma unroll
                for (int k = 0; k < D / 32; k++) {
                    cp16(sk + k_off + k * 512, gk + k * 512);
                    cp16(sv + v_off[k % 4] + (k / 4) * 2048, gv + k * 512);
                }
#if PAGED
                if (lane < 16) cp16(sk + 2 * CODE_BYTES + lane * 16, sc_src + pblk * ssb + pslot);
#else
                if (lane < 16) cp16(sk + 2 * CODE_BYTES + lane * 16, sc_src + issue_slot);
#endif
                issue_slot += W * BLK;
                if (ring && issue_slot >= cap) issue_slot -= cap;
            }
            cp_commit();
        };
#pragma unroll
        for (int i = 0; i < STAGES - 1; i++) issue(i);

        // q for head g, packed as the B operand of the score mma: k step s, register 0 holds the coordinates of
        // nibbles 0-3 of code word WPT t + s (4w, 4w + D/2, 4w + 1, 4w + 1 + D/2), register 1 those of nibbles 4-7
        u32 qf[QP][WPT][2];
        float qmax0 = 1e-30f, qmax1 = 1e-30f;
        int qs0[QP], qs1[QP];
        {
            // quantized once per program: warp w packs steps w, w + W, .. of every lane's fragment into shared
            // memory (Qs, lanes side by side: no bank conflicts), then every warp reads all of them. Per head g:
            // the max |q| sets the scale; sum q starts the score accumulators (the levels come out as L - 1)
            float qv[SPW][2][4];  // [step][half][4 coordinates 4 (WPT t + s) ..]
            float mx = 0.f;
#pragma unroll
            for (int j = 0; j < SPW; j++)
#pragma unroll
                for (int hf = 0; hf < 2; hf++) {
                    const float4 x = qx[j][hf];
                    qv[j][hf][0] = x.x; qv[j][hf][1] = x.y; qv[j][hf][2] = x.z; qv[j][hf][3] = x.w;
                    mx = fmaxf(mx, fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w))));
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            if (t == 0) qmx[warp * 8 + g] = mx;
            __syncthreads();
            float qmax_g = 1e-30f;
#pragma unroll
            for (int w = 0; w < W; w++) {
                qmax_g = fmaxf(qmax_g, qmx[w * 8 + g]);
                qmax0 = fmaxf(qmax0, qmx[w * 8 + 2 * t]);
                qmax1 = fmaxf(qmax1, qmx[w * 8 + 2 * t + 1]);
            }
            const float qsc = (QP == 2 ? 127.f * 128.f : 127.f) / qmax_g;
            int sum[QP];
#pragma unroll
            for (int k = 0; k < QP; k++) sum[k] = 0;
#pragma unroll
            for (int j = 0; j < SPW; j++) {
                const int s = warp + j * W;
                if (s < WPT) {
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        u32 pk[QP];
#pragma unroll
                        for (int k = 0; k < QP; k++) pk[k] = 0;
#pragma unroll
                        for (int i = 0; i < 4; i++) {
                            // nibble 4 r + i of word WPT t + s: coordinate 4 w + 2 r + i / 2 (+ D/2 if i is odd)
                            const int v = rni(qv[j][i & 1][2 * r + (i >> 1)] * qsc);
                            int parts[QP];
                            if (QP == 2) {
                                const int a = rni(v * (1.f / 128.f));
                                parts[0] = a;
                                parts[QP - 1] = v - 128 * a;
                            } else {
                                parts[0] = v;
                            }
#pragma unroll
                            for (int k = 0; k < QP; k++) {
                                pk[k] |= ((u32)(parts[k] & 0xff)) << (8 * i);
                                sum[k] += parts[k];
                            }
                        }
#pragma unroll
                        for (int k = 0; k < QP; k++) Qs[((k * WPT + s) * 2 + r) * 32 + lane] = pk[k];
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < QP; k++) {
                sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 1);
                sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 2);
                if (t == 0) qsm[(warp * 8 + g) * QP + k] = sum[k];
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < QP; k++) {
#pragma unroll
                for (int s = 0; s < WPT; s++)
#pragma unroll
                    for (int r = 0; r < 2; r++) qf[k][s][r] = Qs[((k * WPT + s) * 2 + r) * 32 + lane];
                qs0[k] = qs1[k] = 0;
#pragma unroll
                for (int w = 0; w < W; w++) {
                    qs0[k] += qsm[(w * 8 + 2 * t) * QP + k];
                    qs1[k] += qsm[(w * 8 + 2 * t + 1) * QP + k];
                }
            }
            // the per-head factor from integer scores to log2 units
            const float unit = scale_log2 * level_step / (QP == 2 ? 127.f * 128.f : 127.f);
            const float f0 = unit * qmax0, f1 = unit * qmax1;

            // P V sums since the last flush for P's high and low bytes, and sum P (a row of ones); the fp32 sums
            // (Ow, this thread's own elements) are written by the first flush, read and written by the next ones
            bool wrote = false;
            int ch[NJJ][4][4] = {}, cl[NJJ][4][4] = {}, psh[4] = {}, psl[4] = {};
            float vmax = 0.f;
            int since = 0;

            for (int i = 0; i < my_blocks; i++) {
                cp_wait_ahead();
                __syncwarp();
                issue(i + STAGES - 1);
                const unsigned char* st = stage0 + (i % STAGES) * STAGE_BYTES;
                const float* ksc = (const float*)(st + 2 * CODE_BYTES);
                const float* vsc = ksc + BLK;
                const int pb = (blk0 + warp + i * W) * BLK;

                // scores: two m tiles of 16 positions
                int sc[2][QP][4];
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
#pragma unroll
                    for (int k = 0; k < QP; k++) {
                        sc[mt][k][0] = qs0[k]; sc[mt][k][1] = qs1[k];
                        sc[mt][k][2] = qs0[k]; sc[mt][k][3] = qs1[k];
                    }
                    const int ra = 16 * mt + g, rb = ra + 8;
                    u32 wa[WPT], wb[WPT];
#if D == 256
#pragma unroll
                    for (int hh = 0; hh < 2; hh++) {
                        const U4 xa = *(const U4*)(st + ra * DH + (((2 * t + hh) ^ (ra & 1)) * 16));
                        const U4 xb = *(const U4*)(st + rb * DH + (((2 * t + hh) ^ (rb & 1)) * 16));
                        wa[4 * hh] = xa.x; wa[4 * hh + 1] = xa.y; wa[4 * hh + 2] = xa.z; wa[4 * hh + 3] = xa.w;
                        wb[4 * hh] = xb.x; wb[4 * hh + 1] = xb.y; wb[4 * hh + 2] = xb.z; wb[4 * hh + 3] = xb.w;
                    }
#elif D == 128
                    {
                        const U4 xa = *(const U4*)(st + ra * DH + t * 16);
                        const U4 xb = *(const U4*)(st + rb * DH + t * 16);
                        wa[0] = xa.x; wa[1] = xa.y; wa[2] = xa.z; wa[3] = xa.w;
                        wb[0] = xb.x; wb[1] = xb.y; wb[2] = xb.z; wb[3] = xb.w;
                    }
#else
                    {
                        const uint2 xa = *(const uint2*)(st + ra * DH + t * 8);
                        const uint2 xb = *(const uint2*)(st + rb * DH + t * 8);
                        wa[0] = xa.x; wa[1] = xa.y;
                        wb[0] = xb.x; wb[1] = xb.y;
                    }
#endif
#pragma unroll
                    for (int s = 0; s < WPT; s++) {
                        const Lv la = levels(wa[s], ta0, ta1, tb0, tb1);
                        const Lv lb = levels(wb[s], ta0, ta1, tb0, tb1);
#pragma unroll
                        for (int k = 0; k < QP; k++) {
                            mma_s8s8(sc[mt][k], la.a_lo, lb.a_lo, la.a_hi, lb.a_hi, qf[k][s][0], qf[k][s][1]);
                            mma_s8s8(sc[mt][k], la.b_lo, lb.b_lo, la.b_hi, lb.b_hi, qf[k][s][0], qf[k][s][1]);
                        }
                    }
                }
                // to log2 units, masked; the block's max per head and of the value scales
                float x[2][4], vsv[2][4];
                float bm0 = -INF, bm1 = -INF, bv = 0.f;
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = 16 * mt + g + 8 * (e >> 1);
                        const int pp = pb + r;
                        const bool ok = pp >= s_start && pp < s_stop;
                        const float s = QP == 2 ? 128.f * (float)sc[mt][0][e] + (float)sc[mt][QP - 1][e]
                                                : (float)sc[mt][0][e];
                        const float xv = s * ((e & 1) ? f1 : f0) * ksc[r];
                        x[mt][e] = ok ? xv : -INF;
                        vsv[mt][e] = ok ? vsc[r] : 0.f;
                        if (e & 1) bm1 = fmaxf(bm1, x[mt][e]);
                        else bm0 = fmaxf(bm0, x[mt][e]);
                        bv = fmaxf(bv, vsv[mt][e]);
                    }
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) {
                    bm0 = fmaxf(bm0, __shfl_xor_sync(0xffffffffu, bm0, o));
                    bm1 = fmaxf(bm1, __shfl_xor_sync(0xffffffffu, bm1, o));
                    bv = fmaxf(bv, __shfl_xor_sync(0xffffffffu, bv, o));
                }
                if (bm0 > m0 || bm1 > m1 || bv > vmax || since == FLUSH_BLOCKS) {
                    // move the int32 sums into the fp32 ones, rescaled to the new maxima. A maximum that moves
                    // moves with headroom (x 2, 2 of P's 16 bits) so that the next blocks seldom move it again
                    const float n0 = bm0 > m0 ? bm0 + 1.f : m0, n1 = bm1 > m1 ? bm1 + 1.f : m1;
                    const float nv = bv > vmax ? 2.f * bv : vmax;
                    const float a0 = m0 == -INF ? 0.f : ex2(m0 - n0);
                    const float a1 = m1 == -INF ? 0.f : ex2(m1 - n1);
                    if (since > 0)  // (nothing to move before the first block)
                        flush(Ow, ch, cl, psh, psl, vmax * level_step * (1.f / 65535.f), a0, a1, g, t, wrote);
                    l0 *= a0;
                    l1 *= a1;
                    m0 = n0;
                    m1 = n1;
                    vmax = nv;
                    since = 0;
                }
                since++;
                // probabilities in 16 bits, P = 2^(x - m) vscale / vscale_max * 65535 (m and vscale_max are bounds,
                // not the maxima: the headroom above), its high and low bytes in
                // this warp's [byte][head][position] area (8 bits alone lose too much where attention is flat)
                const float pv = vmax > 0.f ? 65535.f / vmax : 0.f;
#pragma unroll
                for (int mt = 0; mt < 2; mt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const float lt = ex2(x[mt][e] - ((e & 1) ? m1 : m0));
                        if (e & 1) l1 += lt;
                        else l0 += lt;
                        const int pq = rni(lt * vsv[mt][e] * pv);
                        const int at = (2 * t + (e & 1)) * BLK + 16 * mt + g + 8 * (e >> 1);
                        Ps[at] = (unsigned char)(pq >> 8);
                        Ps[256 + at] = (unsigned char)pq;
                    }
                __syncwarp();
                const u32 ph0 = *(const u32*)(Ps + g * BLK + 4 * t), ph1 = *(const u32*)(Ps + g * BLK + 16 + 4 * t);
                const u32 pl0 = *(const u32*)(Ps + 256 + g * BLK + 4 * t);
                const u32 pl1 = *(const u32*)(Ps + 256 + g * BLK + 16 + 4 * t);
                mma_s8u8(psh, 0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u, ph0, ph1);
                mma_s8u8(psl, 0x01010101u, 0x01010101u, 0x01010101u, 0x01010101u, pl0, pl1);
                // P V: per group jj, words (u, c) for u = t, t + 4 and c = 4 (8 jj + g) .. + 3
                const unsigned char* sv = st + CODE_BYTES;
#pragma unroll
                for (int jj = 0; jj < NJJ; jj++) {
                    const int chk = 8 * jj + g;
                    const U4 w0 = *(const U4*)(sv + t * (DH * 4) + ((chk ^ (2 * t)) * 16));
                    const U4 w1 = *(const U4*)(sv + (t + 4) * (DH * 4) + ((chk ^ (2 * t)) * 16));
                    const Lv v00 = value_levels(w0.x, ta0, ta1, tb0, tb1);  // coordinate c0, positions 4t..
                    const Lv v01 = value_levels(w0.y, ta0, ta1, tb0, tb1);  // c0 + 1
                    const Lv v02 = value_levels(w0.z, ta0, ta1, tb0, tb1);  // c0 + 2
                    const Lv v03 = value_levels(w0.w, ta0, ta1, tb0, tb1);  // c0 + 3
                    const Lv v10 = value_levels(w1.x, ta0, ta1, tb0, tb1);  // c0, positions 16 + 4t..
                    const Lv v11 = value_levels(w1.y, ta0, ta1, tb0, tb1);
                    const Lv v12 = value_levels(w1.z, ta0, ta1, tb0, tb1);
                    const Lv v13 = value_levels(w1.w, ta0, ta1, tb0, tb1);
                    // tiles: 0 rows (c0, c0 + 1), 1 rows (c0 + 2, c0 + 3), 2 and 3 their partners + D/2; each
                    // with the levels' two parts and P's two bytes
                    pv_mma(ch[jj][0], cl[jj][0], v00.a_lo, v01.a_lo, v10.a_lo, v11.a_lo, ph0, ph1, pl0, pl1);
                    pv_mma(ch[jj][0], cl[jj][0], v00.b_lo, v01.b_lo, v10.b_lo, v11.b_lo, ph0, ph1, pl0, pl1);
                    pv_mma(ch[jj][1], cl[jj][1], v02.a_lo, v03.a_lo, v12.a_lo, v13.a_lo, ph0, ph1, pl0, pl1);
                    pv_mma(ch[jj][1], cl[jj][1], v02.b_lo, v03.b_lo, v12.b_lo, v13.b_lo, ph0, ph1, pl0, pl1);
                    pv_mma(ch[jj][2], cl[jj][2], v00.a_hi, v01.a_hi, v10.a_hi, v11.a_hi, ph0, ph1, pl0, pl1);
                    pv_mma(ch[jj][2], cl[jj][2], v00.b_hi, v01.b_hi, v10.b_hi, v11.b_hi, ph0, ph1, pl0, pl1);
                    pv_mma(ch[jj][3], cl[jj][3], v02.a_hi, v03.a_hi, v12.a_hi, v13.a_hi, ph0, ph1, pl0, pl1);
                    pv_mma(ch[jj][3], cl[jj][3], v02.b_hi, v03.b_hi, v12.b_hi, v13.b_hi, ph0, ph1, pl0, pl1);
                }
            }
            // the last sums
            flush(Ow, ch, cl, psh, psl, vmax * level_step * (1.f / 65535.f), 1.f, 1.f, g, t, wrote);
        }
        cp_wait_all();
        // sum l over the positions (lanes g) of each head
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            l0 += __shfl_xor_sync(0xffffffffu, l0, o);
            l1 += __shfl_xor_sync(0xffffffffu, l1, o);
        }
        if (g == 0) {
            ms[warp * 8 + 2 * t] = m0;
            ms[warp * 8 + 2 * t + 1] = m1;
            ls[warp * 8 + 2 * t] = l0;
            ls[warp * 8 + 2 * t + 1] = l1;
        }
    } else {
        // the newest positions, exact, from the ring (slot j % recent): lanes hold coordinates lane + 32 r
        const int rs = max(first, coded_stop);
        const int n_rs = n_splits - n_coded;
        const int len = p + 1 - rs;
        const int per = (len + n_rs - 1) / n_rs;
        const int r0 = rs + (split - n_coded) * per, r1 = min(r0 + per, p + 1);
        float qv[G][D / 32], o[G][D / 32], m[G], l[G];
#pragma unroll
        for (int hq = 0; hq < G; hq++) {
            m[hq] = -INF;
            l[hq] = 0.f;
#pragma unroll
            for (int r = 0; r < D / 32; r++) {
                qv[hq][r] = qrow[hq * sqh + lane + 32 * r];
                o[hq][r] = 0.f;
            }
        }
        const ring_t* kb = kr + row * srb + h * srh;
        const ring_t* vb = vr + row * srb + h * srh;
        // the split's <= 32 rows of K and V into shared memory at once (one round trip, not one a position)
        static_assert(2 * BLK * D * sizeof(ring_t) <= STAGES * W * STAGE_BYTES, "ring rows fit the stages");
        ring_t* Ks = (ring_t*)smem;
        ring_t* Vs = Ks + BLK * D;
        {
            constexpr int CH = D * (int)sizeof(ring_t) / 16;  // 16-byte chunks a row
            const int rows = max(r1 - r0, 0);
            const u32 base = smem_addr(smem);
            for (int idx = threadIdx.x; idx < 2 * rows * CH; idx += W * 32) {
                const int kv = idx / (rows * CH), rem = idx % (rows * CH), r = rem / CH, c = rem % CH;
                const ring_t* src = (kv ? vb : kb) + (i64)((r0 + r) % recent) * D;
                cp16(base + (kv * BLK * D + r * D) * (int)sizeof(ring_t) + c * 16,
                     (const unsigned char*)src + c * 16);
            }
            cp_commit();
            cp_wait_all();
            __syncthreads();
        }
        for (int j = r0 + warp; j < r1; j += W) {
            float kv[D / 32], vv[D / 32];
#pragma unroll
            for (int r = 0; r < D / 32; r++) {
                kv[r] = ring_f(Ks[(j - r0) * D + lane + 32 * r]);
                vv[r] = ring_f(Vs[(j - r0) * D + lane + 32 * r]);
            }
#pragma unroll
            for (int hq = 0; hq < G; hq++) {
                float s = 0.f;
#pragma unroll
                for (int r = 0; r < D / 32; r++) s = fmaf(qv[hq][r], kv[r], s);
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                s *= scale_log2;
                const float mn = fmaxf(m[hq], s);
                const float a = ex2(m[hq] - mn), pr = ex2(s - mn);
                l[hq] = l[hq] * a + pr;
                m[hq] = mn;
#pragma unroll
                for (int r = 0; r < D / 32; r++) o[hq][r] = fmaf(o[hq][r], a, pr * vv[r]);
            }
        }
        __syncthreads();
#pragma unroll
        for (int hq = 0; hq < G; hq++) {
#pragma unroll
            for (int r = 0; r < D / 32; r++) Os[(warp * G + hq) * D + lane + 32 * r] = o[hq][r];
            if (lane == 0) {
                ms[warp * 8 + hq] = m[hq];
                ls[warp * 8 + hq] = l[hq];
            }
        }
    }
#if __CUDA_ARCH__ >= 900
    // the merge kernel (launched with programmatic dependent launch) may start on the SMs this grid frees; it
    // waits for the whole grid before it reads anything. Here, not at the start: at 32k batch 1 the early
    // signal measured slower (H100: 18.4 -> 19.6 us, D = 256), this one faster (22.4 -> 21.5, D = 128)
    asm volatile("griddepcontrol.launch_dependents;");
#endif
    __syncthreads();
    // the warps' partials into the split's: warp w takes heads w, w + W, .. (HPW of them, side by side: their
    // latencies overlap); lane the coordinates lane + 32 i (VPL of them; no bank conflicts). Weights 2^(m_w - M)
    // (a warp that saw nothing has m = -inf, weight 0; every warp wrote its sums, so no NaN is read); with
    // unrotate, R^T o = signs * (H o) / sqrt(D) (linear: each split's partial may be rotated), a Walsh-Hadamard
    // transform in registers (the coordinate bits of i) and shuffles (those of the lane)
    constexpr int VPL = D / 32, HPW = (G + W - 1) / W;
    float o[HPW][VPL], M[HPW], L[HPW];
#pragma unroll
    for (int k = 0; k < HPW; k++) {
        const int hq = min(warp + k * W, G - 1);  // (a warp past the last head redoes it and stores nothing)
        M[k] = -INF;
        L[k] = 0.f;
#pragma unroll
        for (int w = 0; w < W; w++) M[k] = fmaxf(M[k], ms[w * 8 + hq]);
#pragma unroll
        for (int i = 0; i < VPL; i++) o[k][i] = 0.f;
#pragma unroll
        for (int w = 0; w < W; w++) {
            const float mw = ms[w * 8 + hq];
            const float wt = mw == -INF ? 0.f : ex2(mw - M[k]);
            L[k] += wt * ls[w * 8 + hq];
            const float* src = Os + (w * G + hq) * D + lane;
#pragma unroll
            for (int i = 0; i < VPL; i++) o[k][i] = fmaf(wt, src[32 * i], o[k][i]);
        }
    }
    if (unrotate) unrotate_rows<HPW>(o, Sg, lane);
#pragma unroll
    for (int k = 0; k < HPW; k++) {
        const int hq = warp + k * W;
        if (hq < G) {
            float* dst = op + ((i64)part * BG + hq) * D + lane;
#pragma unroll
            for (int i = 0; i < VPL; i++) dst[32 * i] = o[k][i];
            if (lane == 0) {
                ml[((i64)part * 2) * BG + hq] = M[k] == -INF ? -INF : M[k] * LN2;
                ml[((i64)part * 2 + 1) * BG + hq] = L[k];
            }
        }
    }
}
