"""The expert slot cache on the device: `resolve` (one program: the policy of `reference.resolve`, same result to
the bit) and `fill` (the missed experts copied from page-locked host memory into their slots by a kernel that
reads the host memory directly over PCIe). Neither reads anything back to the host, so both run inside a captured
decode graph; the number of misses is known on the device only, so `fill` is launched for the most misses there
can be and its idle programs return at once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# words per program of `fill`, its warps (docs/perf-log.md, 2026-11-25 "streamed experts")
FILL_BLOCK, FILL_WARPS = 1024, 4


@triton.jit
def _resolve_kernel(ids_ptr, out_ptr, slot_of_ptr, expert_in_ptr, stamp_ptr, clock_ptr, stats_ptr, jobs_ptr,
                    njobs_ptr, sorted_ptr, T, E, S, MAX_JOBS, K: tl.constexpr, KA: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr):
    """ids [T, KA] (columns < K routed); jobs [2, MAX_JOBS] (missed experts, then their slots); sorted: scratch
    [BLOCK_S] int64. Global stores are read back by other threads only after a barrier (one program: the CTA's
    barrier makes them visible)."""
    clock = tl.load(clock_ptr) + 1  # stored at the end: every thread must read the old value first
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    wanted = tl.zeros((BLOCK_E,), dtype=tl.int32)
    n = T * K
    for i0 in range(0, n, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        e = tl.load(ids_ptr + (i // K) * KA + i % K, mask=i < n, other=-1)
        wanted = tl.maximum(wanted, tl.max((e[:, None] == offs_e[None, :]).to(tl.int32), axis=0))
    slot = tl.load(slot_of_ptr + offs_e, mask=e_ok, other=-1)
    hit = (wanted > 0) & (slot >= 0)
    miss = (wanted > 0) & (slot < 0)
    tl.store(stamp_ptr + slot, clock, mask=hit)
    tl.debug_barrier()
    offs_s = tl.arange(0, BLOCK_S)
    st = tl.load(stamp_ptr + offs_s, mask=offs_s < S, other=0)
    key = tl.where(offs_s < S, st * BLOCK_S + offs_s, 0x7FFFFFFFFFFFFFFF)  # (stamp, slot), ascending
    tl.store(sorted_ptr + offs_s, tl.sort(key))
    tl.debug_barrier()
    miss_i = miss.to(tl.int32)
    rank = tl.cumsum(miss_i, axis=0) - miss_i  # the k-th missed expert (by id) takes the k-th oldest slot
    victim = (tl.load(sorted_ptr + rank, mask=miss, other=0) & (BLOCK_S - 1)).to(tl.int32)
    old = tl.load(expert_in_ptr + victim, mask=miss, other=-1)
    tl.store(slot_of_ptr + old, -1, mask=miss & (old >= 0))
    tl.debug_barrier()
    tl.store(slot_of_ptr + offs_e, victim, mask=miss)
    tl.store(expert_in_ptr + victim, offs_e, mask=miss)
    tl.store(stamp_ptr + victim, clock, mask=miss)
    tl.store(jobs_ptr + rank, offs_e, mask=miss)
    tl.store(jobs_ptr + MAX_JOBS + rank, victim, mask=miss)
    n_miss = tl.sum(miss_i, axis=0)
    tl.store(njobs_ptr, n_miss)
    tl.store(stats_ptr, tl.load(stats_ptr) + tl.sum(hit.to(tl.int64), axis=0))
    tl.store(stats_ptr + 1, tl.load(stats_ptr + 1) + n_miss.to(tl.int64))
    tl.debug_barrier()
    na = T * KA
    for i0 in range(0, na, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        m = i < na
        e = tl.load(ids_ptr + i, mask=m, other=0)
        routed = (i % KA < K) & (e < E)
        s = tl.load(slot_of_ptr + e, mask=m & routed, other=0)
        tl.store(out_ptr + i, tl.where(routed, s, S + e - E), mask=m)
    tl.store(clock_ptr, clock)


def resolve(ids: torch.Tensor, k: int, slot_of, expert_in, stamp, clock, stats, jobs, n_jobs, scratch):
    """As `reference.resolve`, the fill jobs left on the device: jobs [2, MAX_JOBS] int32, n_jobs [1] int32."""
    T, KA = ids.shape
    E, S = slot_of.numel(), expert_in.numel()
    out = torch.empty_like(ids)
    _resolve_kernel[(1,)](ids, out, slot_of, expert_in, stamp, clock, stats, jobs, n_jobs, scratch, T, E, S,
                          jobs.shape[1], K=k, KA=KA, BLOCK_E=triton.next_power_of_2(E),
                          BLOCK_S=scratch.numel(), BLOCK_I=16, num_warps=4)
    return out


@triton.jit
def _copy_part(src, dst, n, e, s, c):
    m = c < n
    tl.store(dst + s * n + c, tl.load(src + e * n + c, mask=m), mask=m)


@triton.jit
def _fill_kernel(jobs_ptr, njobs_ptr, MAX_JOBS, src0, dst0, n0, src1, dst1, n1, src2, dst2, n2, src3, dst3, n3,
                 src4, dst4, n4, src5, dst5, n5, BLOCK: tl.constexpr):
    """Program (job, block): words [block * BLOCK, +BLOCK) of each of the six parts (gate_up and down: packed
    words, scales, biases, each [E or S, n_p] 4-byte words) of the job's expert, host to slot."""
    j = tl.program_id(0)
    if j >= tl.load(njobs_ptr):
        return
    e = tl.load(jobs_ptr + j).to(tl.int64)
    s = tl.load(jobs_ptr + MAX_JOBS + j).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    _copy_part(src0, dst0, n0, e, s, c)
    _copy_part(src1, dst1, n1, e, s, c)
    _copy_part(src2, dst2, n2, e, s, c)
    _copy_part(src3, dst3, n3, e, s, c)
    _copy_part(src4, dst4, n4, e, s, c)
    _copy_part(src5, dst5, n5, e, s, c)


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.element_size() == 4 else t.view(-1).view(torch.int32)


def fill(host_parts, slot_parts, jobs: torch.Tensor, n_jobs: torch.Tensor, max_jobs: int | None = None,
         block: int = FILL_BLOCK, num_warps: int = FILL_WARPS) -> None:
    """Copy the experts of the fill jobs from the host tensors [E, ...] (page-locked, read in place by the kernel)
    into the slot tensors [S, ...] (every part a whole number of 4-byte words per expert). max_jobs: the most
    jobs there can be (the step's routed pairs), which sizes the grid (default: all of jobs)."""
    args, most = [], 0
    for src, dst in zip(host_parts, slot_parts):
        n = src[0].numel() * src.element_size() // 4
        args += [_words(src), _words(dst), n]
        most = max(most, n)
    grid = (min(max_jobs or jobs.shape[1], jobs.shape[1]), triton.cdiv(most, block))
    _fill_kernel[grid](jobs, n_jobs, jobs.shape[1], *args, BLOCK=block, num_warps=num_warps)
