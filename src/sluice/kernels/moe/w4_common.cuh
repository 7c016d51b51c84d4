// Device helpers of the 4-bit MLX-affine tensor-core kernels (w4_mma.cu, w4_wgmma.cu); mma.py and wgmma.py put this
// text before each kernel's source. Compile-time: FP16 (else bf16), STAGES (cp.async chunks in flight + 1).

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

struct __align__(16) U4 { u32 x, y, z, w; };

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
