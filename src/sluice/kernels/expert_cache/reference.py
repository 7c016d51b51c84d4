"""The expert slot cache's policy in plain torch: obviously right, the oracle of `triton.py` and the CPU path.

State of one layer's cache (all int tensors on the cache's device):
  slot_of [E] int32: the slot holding expert e, or -1;
  expert_in [S] int32: the expert in slot s, or -1 (empty);
  stamp [S] int64: the step that last used slot s (0: never);
  clock [1] int64: the step count;
  stats [2] int64: hits and misses so far, in distinct experts per step.

`resolve(ids, k)` for one step: every distinct expert among the routed columns ids[:, :k] is wanted. Wanted experts
already in a slot are hits (their slots stamped with this step); the misses, in increasing expert id, take the
slots with the oldest stamps, ties to the lower slot (empty slots first), never a slot a hit of this step uses. The
distinct wanted experts must not outnumber the slots (the caller routes at most S (token, expert) pairs through the
cache). Returns the ids with each routed expert replaced by its slot and every other id (the shared expert's
slots, ids E + i) by S + i, plus the fill jobs: the missed experts and their slots.
"""

from __future__ import annotations

import torch


def resolve(ids: torch.Tensor, k: int, slot_of: torch.Tensor, expert_in: torch.Tensor, stamp: torch.Tensor,
            clock: torch.Tensor, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot ids int32 like ids, missed experts [m] int64, their slots [m] int64); updates the state in place."""
    E, S = slot_of.numel(), expert_in.numel()
    clock += 1
    wanted = torch.zeros(E, dtype=torch.bool, device=ids.device)
    wanted[ids[:, :k].reshape(-1).long()] = True
    hit = wanted & (slot_of >= 0)
    miss = wanted & (slot_of < 0)
    stamp[slot_of[hit].long()] = clock
    missed = miss.nonzero()[:, 0]
    if missed.numel() > (stamp < clock).sum():
        raise ValueError(f"expert cache: {int(wanted.sum())} distinct experts in one step, more than the {S} slots")
    victims = torch.sort(stamp, stable=True).indices[: missed.numel()]
    old = expert_in[victims].long()
    slot_of[old[old >= 0]] = -1
    slot_of[missed] = victims.to(slot_of.dtype)
    expert_in[victims] = missed.to(expert_in.dtype)
    stamp[victims] = clock
    stats += torch.stack([hit.sum(), miss.sum()]).to(stats.dtype)
    routed = ids < E
    out = torch.where(routed, slot_of[ids.clamp(max=E - 1).long()], ids + (S - E)).to(torch.int32)
    return out, missed, victims


def fill(host_parts, slot_parts, missed: torch.Tensor, victims: torch.Tensor) -> None:
    """Copy experts `missed` of each host tensor [E, ...] into slots `victims` of its slot tensor [S, ...]."""
    for src, dst in zip(host_parts, slot_parts):
        if src.dtype == torch.uint32:  # few ops take uint32: copy the same bits as int32
            src, dst = src.view(torch.int32), dst.view(torch.int32)
        dst[victims.to(dst.device)] = src[missed.to(src.device)].to(dst.device)
