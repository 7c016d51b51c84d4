"""Placement of a model's weights under a device memory budget: which routed experts stream, and how many slots
each MoE layer keeps on the device.

Decided twice: before loading (`streams`), from the checkpoint's tensor sizes, whether the routed experts must
stay in host memory (then the loader reads them there, never to the device); after building (`place`), from
what the rest of the model really takes, the slots per layer. Below 3 x top-k slots per layer an LRU cache hits
almost nothing (docs/perf-log.md, 2026-11-25 "streamed experts"), so a smaller budget is refused, naming the
smallest that works."""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass

import torch

from sluice.errors import InvalidOptionError, UnsupportedError

CACHE_RESERVE = 2 << 30  # bytes of the budget left for KV caches, recurrent states, activations and graphs
HOST_RESERVE = 4 << 30  # host memory left free when deciding whether the experts fit in host RAM
MIN_SLOTS_PER_TOP_K = 3
EXPERT_STORES = ("auto", "host", "disk")
_ROUTED = (".switch_mlp.", ".mlp.experts.")


def is_routed_expert(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the routed experts (MLX switch_mlp, HF experts), not the shared one
    (nor to the multi-token-prediction layer, which sluice does not load)."""
    return any(p in name for p in _ROUTED) and "mtp." not in name


def parse_bytes(text) -> int:
    """'24GiB', '20GB', '512MiB', '1.5T' or a number of bytes -> bytes (InvalidOptionError otherwise)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        s = str(text).strip().replace(" ", "")
        i = len(s) - len(s.lstrip("0123456789.")) if s[:1].isdigit() or s[:1] == "." else 0
        value_text, unit = s[:i], s[i:].lower().removesuffix("b")
        try:
            value = float(value_text)
        except ValueError:
            value = -1.0
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    if unit not in scale or not value > 0 or value * scale[unit] > 2**60:
        raise InvalidOptionError(f"gpu_memory={text!r}: use a size such as 24GiB, 20GB or 512MiB.")
    return int(value * scale[unit])


def streams(src, device: torch.device, gpu_memory: int | None, expert_slots: int | None,
            expert_store: str = "auto") -> str | None:
    """Where the routed experts of checkpoint `src` stay, if not on the device: "host" (host memory) or "disk" (the
    checkpoint's files); None: everything on the device. They stream when asked to (expert_slots, or
    expert_store="disk") or when the checkpoint does not fit the budget (gpu_memory, else the free device memory)
    with room for the caches; then in host memory if they fit there (expert_store="auto"), else from disk."""
    if expert_store not in EXPERT_STORES:
        raise InvalidOptionError(f"expert_store={expert_store!r}: use one of {', '.join(EXPERT_STORES)}.")
    tp = getattr(src, "tp", None)  # a tensor-parallel rank: every decision agreed over the ranks (lockstep)
    sizes = src.tensor_nbytes() if hasattr(src, "tensor_nbytes") else {}
    experts = sum(n for name, n in sizes.items() if is_routed_expert(name))
    asked = expert_slots is not None or expert_store == "disk"
    if asked and not experts:
        raise UnsupportedError("expert_slots / expert_store: this model has no routed experts to stream.")
    if not asked:
        budget = gpu_memory if gpu_memory is not None else (
            torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)
        total = getattr(src, "total_bytes", 0)
        if tp is not None:  # a rank holds about its share
            total //= tp.size
            budget = budget if budget is None else tp.agree(budget, min, device)
        if budget is None or total + CACHE_RESERVE <= budget:
            return None
        if not experts:
            if gpu_memory is not None:
                raise InvalidOptionError(f"gpu_memory: the model takes {total / 2**30:.1f} GiB (and ~"
                                         f"{CACHE_RESERVE / 2**30:.0f} GiB for caches), more than the "
                                         f"{budget / 2**30:.1f} GiB given, and has no routed experts that could "
                                         "stay off the device.")
            return None
    on_disk = hasattr(src, "location")
    if expert_store == "disk" and not on_disk:
        raise InvalidOptionError("expert_store='disk' reads the experts from a checkpoint directory's files; this "
                                 "checkpoint has none (dummy weights: write them to disk first).")
    if expert_store == "auto" and on_disk:
        from sluice.engine.runner import available_memory

        host = available_memory(torch.device("cpu"))
        if tp is not None:
            host = tp.agree(host, min, device)
        return "host" if experts + HOST_RESERVE <= host else "disk"
    return "disk" if expert_store == "disk" else "host"


@dataclass
class Placement:
    """What `place` decided (reported by `Model.info`, `sluice info` and `bench`)."""

    layers: int
    experts: int
    slots: int
    top_k: int
    expert_bytes: int
    resident_bytes: int
    budget: int | None
    caches: list

    @property
    def host_bytes(self) -> int:
        return self.layers * self.experts * self.expert_bytes

    @property
    def slot_bytes(self) -> int:
        return self.layers * self.slots * self.expert_bytes

    @property
    def max_cached_tokens(self) -> int:
        """The most tokens a step may have to run from the slots; bigger steps stage whole layers."""
        return self.slots // self.top_k if self.slots < self.experts else 1 << 30

    @property
    def max_graph_tokens(self) -> int:
        """The most tokens a decode step may have to be graph-captured: none when a miss needs the host (a disk
        store reads it), else those that run from the slots."""
        return self.max_cached_tokens if self.caches[0].in_graph else 0  # one store kind for all layers

    def hit_rate(self) -> float | None:
        """Hits over lookups so far (distinct experts a step, all layers), read back in one transfer."""
        hits, misses = torch.stack([c.stats for c in self.caches]).sum(0).tolist()
        return hits / (hits + misses) if hits + misses else None

    def reset_stats(self) -> None:
        """Forget the lookups so far (those of a warm-up)."""
        for c in self.caches:
            c.stats.zero_()

    def summary(self) -> dict:
        return {"streamed_layers": self.layers, "experts_per_layer": self.experts, "slots_per_layer": self.slots,
                "expert_bytes": self.expert_bytes, "host_expert_bytes": self.host_bytes,
                "slot_bytes": self.slot_bytes, "resident_bytes": self.resident_bytes, "budget_bytes": self.budget,
                "store": self.store, "disk_bytes_read": self.disk_bytes_read(), "hit_rate": self.hit_rate()}

    @property
    def store(self) -> str:
        return "host" if self.caches[0].store.in_place else "disk"

    def disk_bytes_read(self) -> int:
        return sum(getattr(c.store, "bytes_read", 0) for c in self.caches)

    def describe(self) -> str:
        gb = 1e9
        where = ("read from the checkpoint's files" if self.store == "disk" else
                 f"in {'page-locked ' if self.caches[0].device.type == 'cuda' else ''}host memory")
        return (f"routed experts {where} ({self.host_bytes / gb:.1f} GB); {self.slots} of {self.experts} experts a "
                f"layer in device slots ({self.slot_bytes / gb:.1f} GB); {self.resident_bytes / gb:.1f} GB of other "
                "weights on the device")


def place(module, device: torch.device, gpu_memory: int | None, expert_slots: int | None,
          disk: tuple | None = None, cache_reserve: int | None = None) -> Placement | None:
    """Give every MoE layer of a model built with its routed experts off the device an `ExpertCache`: over its host
    tensors, or (disk = (checkpoint, the MoE layers' name prefixes in order), the experts built as meta tensors) over
    the checkpoint's files. None (and the host experts moved to the device) when all of them fit after all.
    cache_reserve: the bytes of the budget kept for caches, activations and graphs (default `CACHE_RESERVE`; the
    loader passes what the engine's settings need, `engine/loader.py` `_cache_reserve`)."""
    from sluice.experts.cache import ExpertCache, LayerStaging
    from sluice.experts.store import HostStore
    from sluice.layers.moe import SparseMoE
    from sluice.quant.affine import QuantizedTensor

    moes = [m for m in module.modules() if isinstance(m, SparseMoE)]
    if any(not isinstance(w, QuantizedTensor) for m in moes for w in (m.gate_up, m.down)):
        raise UnsupportedError("streaming experts needs quantized experts (an MLX checkpoint, `sluice convert`, or "
                               "--load-format dummy with a quantization block).")
    first = moes[0]
    layout = _layout(first)
    if any(_layout(m) != layout for m in moes[1:]):
        raise UnsupportedError("streaming experts needs every MoE layer to store its experts alike (the same shapes, "
                               "bits and group sizes); this checkpoint mixes them.")
    E, k, L = first.num_experts, first.top_k, len(moes)
    expert_bytes = sum(t[0].nbytes for w in (first.gate_up, first.down) for t in (w.weight, w.scales, w.biases))
    staging = LayerStaging(device)
    staging_bytes = 2 * E * expert_bytes if device.type == "cuda" else 0
    resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else _resident_bytes(module, moes)
    smallest = min(MIN_SLOTS_PER_TOP_K * k, E)
    reserve = CACHE_RESERVE if cache_reserve is None else cache_reserve
    if expert_slots is None:
        free = gpu_memory if gpu_memory is not None else (
            torch.cuda.mem_get_info(device)[0] + resident if device.type == "cuda" else None)
        if free is None:  # no budget off the GPU (a disk store asked for): a slot for every expert
            slots = E
        else:
            room = free - resident - reserve - staging_bytes
            slots = min(E, max(0, room // (L * expert_bytes)))
            tp = getattr(module, "tp", None)
            if tp is not None:  # the same slots on every rank of a tensor-parallel group (lockstep)
                slots = tp.agree(slots, min, device)
        if slots == E and disk is None:  # it all fits after all
            for m in moes:
                m.gate_up, m.down = m.gate_up.to(device), m.down.to(device)
            return None
        if slots < smallest:
            need = resident + reserve + staging_bytes + L * smallest * expert_bytes
            raise InvalidOptionError(
                f"a device memory budget of {free / 2**30:.1f} GiB is too small for this model: it needs "
                f"{resident / 2**30:.1f} GiB for the weights other than the routed experts, "
                f"{reserve / 2**30:.1f} GiB for caches, {staging_bytes / 2**30:.1f} GiB to stage a layer's "
                f"experts and at least {smallest} expert slots a layer ({L * smallest * expert_bytes / 2**30:.1f} "
                f"GiB; fewer make the cache useless). The smallest budget that works is "
                f"{math.ceil(need / 2**30 * 10) / 10:.1f} GiB.")
    else:
        if not smallest <= expert_slots <= E:
            raise InvalidOptionError(f"expert_slots={expert_slots}: use {smallest} (3 x top-k, at most the {E} "
                                     f"experts) to {E}.")
        slots = expert_slots
    caches, fds = [], {}
    for i, m in enumerate(moes):
        if disk is not None:
            store, experts = _disk_store(disk[0], disk[1][i], m, fds), (m.gate_up, m.down)
        else:
            experts = tuple(_page_locked(w) if device.type == "cuda" else w for w in (m.gate_up, m.down))
            store = HostStore(*experts)
        caches.append(ExpertCache(store, experts, slots, device, staging, i))
        m.stream_from(caches[-1])
    staging.caches = caches
    placement = Placement(L, E, slots, k, expert_bytes, resident, gpu_memory, caches)
    if getattr(getattr(module, "tp", None), "rank", 0) == 0:
        print(f"sluice: {placement.describe()}", file=sys.stderr)
    return placement


def _disk_store(src, prefix: str, moe, fds: dict):
    """The DiskStore of one MoE layer of an MLX checkpoint: gate, up and down projections (weight, scales, biases
    each) stacked per projection in the files, read into the slot parts' rows."""
    from sluice.experts.store import DiskStore, FilePiece

    I = moe.down.in_features
    pieces = []
    for proj, row0, part0 in (("gate_proj", 0, 0), ("up_proj", I, 0), ("down_proj", 0, 3)):
        for j, field in enumerate(("weight", "scales", "biases")):
            name = f"{prefix}switch_mlp.{proj}.{field}"
            if not src.has(name):
                raise UnsupportedError(f"{src.path}: streaming experts from disk needs an MLX-layout checkpoint "
                                       f"(switch_mlp.*), found no '{name}'.")
            file, start, nbytes, shape, dtype = src.location(name)
            E = shape[0]
            pieces.append(FilePiece(part0 + j, row0, file, start, nbytes // E, tuple(shape[1:]), dtype))
    return DiskStore(pieces, (moe.gate_up, moe.down), fds)


def _layout(moe) -> tuple:
    """What must agree between the MoE layers that share one set of staging buffers and one slot size."""
    return tuple((tuple(t.shape), t.dtype, q.bits, q.group_size) for q in (moe.gate_up, moe.down)
                 for t in (q.weight, q.scales, q.biases))


def _resident_bytes(module, moes) -> int:
    """Bytes of every tensor of the model but the routed experts (what stays on the device)."""
    experts = {id(t) for m in moes for w in (m.gate_up, m.down) for t in (w.weight, w.scales, w.biases)}
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers(), *_quantized_tensors(module)]:
        if id(t) not in experts and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _quantized_tensors(module):
    from sluice.quant.affine import QuantizedTensor

    for mod in module.modules():
        for v in vars(mod).values():
            if isinstance(v, QuantizedTensor):
                yield from (v.weight, v.scales, v.biases)
            elif isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
                yield v


def _page_locked(qt):
    """A copy of a host QuantizedTensor in page-locked memory (cudaHostRegister on fresh memory of the exact size:
    the caching pinned allocator would round each allocation up to a power of two), readable by kernels in place."""
    from sluice.quant.affine import QuantizedTensor

    parts = []
    for t in (qt.weight, qt.scales, qt.biases):
        t = t.contiguous().clone()
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 3)  # portable | mapped
        if int(err) != 0:
            raise InvalidOptionError(f"could not page-lock {t.nbytes / 2**30:.1f} GiB of host memory for the experts "
                                     f"(CUDA error {int(err)}); is the host short of memory?")
        weakref.finalize(t, torch.cuda.cudart().cudaHostUnregister, t.data_ptr())
        parts.append(t)
    return QuantizedTensor(*parts, qt.bits, qt.group_size)
