"""One MoE layer's slot cache of routed experts, and the double-buffered whole-layer staging of big steps."""

from __future__ import annotations

import torch

from sluice.errors import ModelFileError
from sluice.experts.store import parts as _parts
from sluice.kernels.expert_cache import reference
from sluice.quant.affine import QuantizedTensor


def _empty_like(qt: QuantizedTensor, n: int, device) -> QuantizedTensor:
    """A stacked QuantizedTensor of n experts shaped like qt's, zeros, on `device`."""
    return QuantizedTensor(*(torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=device)
                             for t in (qt.weight, qt.scales, qt.biases)), qt.bits, qt.group_size)


class ExpertCache:
    """The routed experts of one MoE layer: all E in a store (`experts/store.py`: host memory or the checkpoint's
    files), S of them in device slots (`gate_up`, `down`: stacked like the full experts, so the MoE kernels run on
    them unchanged). `experts`: the full stacked experts as the store holds them (host tensors), or their shapes
    only (meta tensors) for a disk store.

    `for_step(ids, k)` gives the expert weights and ids a step's MoE runs on: the slots and the ids mapped to
    them when the step's k-routed pairs fit the slots (misses copied in first), else the whole layer from the
    staging buffers with the ids as they are. The slot policy (least recently used) is `kernels/expert_cache`."""

    def __init__(self, store, experts: tuple[QuantizedTensor, QuantizedTensor], slots: int, device: torch.device,
                 staging: LayerStaging, index: int):
        self.store, self.experts = store, experts
        self.num_experts, self.slots, self.device = experts[0].weight.shape[0], slots, torch.device(device)
        self.gate_up, self.down = (_empty_like(q, slots, device) for q in experts)
        self.staging, self.index = staging, index
        E, S = self.num_experts, slots
        self.slot_of = torch.full((E,), -1, dtype=torch.int32, device=device)
        self.expert_in = torch.full((S,), -1, dtype=torch.int32, device=device)
        self.stamp = torch.zeros(S, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.stats = torch.zeros(2, dtype=torch.int64, device=device)  # hits, misses (distinct experts a step)
        self._kernels = None
        if self.device.type == "cuda":  # resolve on the device; fill there too when the store allows it
            from sluice.kernels.expert_cache import triton as kernels

            self._kernels = kernels
            self._scratch = torch.empty(1 << (S - 1).bit_length(), dtype=torch.int64, device=device)
            self._n_jobs = torch.zeros(1, dtype=torch.int32, device=device)
            self._jobs = torch.zeros(2, S, dtype=torch.int32, device=device)

    @property
    def expert_bytes(self) -> int:
        return sum(t[0].nbytes for t in _parts(*self.experts))

    @property
    def in_graph(self) -> bool:
        """Whether a step from the slots needs nothing from the host (then it can be graph-captured)."""
        return self._kernels is not None and self.store.in_place

    def fits(self, tokens: int, k: int) -> bool:
        """Whether a step of `tokens` tokens runs from the slots (else from the staged whole layer): its distinct
        experts, at most tokens * k and at most E, always fit."""
        return min(tokens * k, self.num_experts) <= self.slots

    def _distinct_fit(self, ids: torch.Tensor, k: int) -> bool:
        """Whether a step too big to fit the slots by its size still does by its distinct experts (counted on the
        host: such steps run eagerly, never in a graph): a batch that shares experts, a short prompt."""
        return int(torch.unique(ids[:, :k]).numel()) <= self.slots

    def for_step(self, ids: torch.Tensor, k: int) -> tuple[QuantizedTensor, QuantizedTensor, torch.Tensor]:
        """(gate_up, down, ids) for a step routed to ids [T, k + n] (columns past k: the shared expert's n slots,
        ids E + i, which become S + i)."""
        if not self.fits(ids.shape[0], k) and not self._distinct_fit(ids, k):
            gate_up, down = self.staging.layer(self)
            return gate_up, down, ids
        slots = _parts(self.gate_up, self.down)
        if self._kernels is None:
            out, missed, victims = reference.resolve(ids, k, self.slot_of, self.expert_in, self.stamp, self.clock,
                                                     self.stats)
            self._fill(missed.tolist(), victims.tolist(), slots)
            return self.gate_up, self.down, out
        out = self._kernels.resolve(ids, k, self.slot_of, self.expert_in, self.stamp, self.clock, self.stats,
                                    self._jobs, self._n_jobs, self._scratch)
        if self.store.in_place:
            self._kernels.fill(_parts(*self.experts), slots, self._jobs, self._n_jobs, ids.shape[0] * k)
        else:  # the host must read the misses: one sync a layer (no graph)
            n = int(self._n_jobs)
            missed, victims = self._jobs[:, :n].tolist()
            self._fill(missed, victims, slots)
        return self.gate_up, self.down, out

    def _fill(self, missed: list, victims: list, slots: list[torch.Tensor]) -> None:
        """The store fills the slots the policy gave the misses; if it cannot (a read fails), those slots are
        emptied again, so no later step takes them for the experts they never received."""
        try:
            self.store.fill(missed, victims, slots)
        except OSError as e:
            v = torch.as_tensor(victims, dtype=torch.long, device=self.device)
            self.slot_of[torch.as_tensor(missed, dtype=torch.long, device=self.device)] = -1
            self.expert_in[v], self.stamp[v] = -1, 0
            raise ModelFileError(f"could not read experts of MoE layer {self.index} from the checkpoint: {e}") from e


class LayerStaging:
    """Two device buffers of one whole layer's experts: a big step's MoE reads its layer from one while the next
    layer's experts are copied into the other on a side stream (on the CPU the host experts are used directly)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.caches: list[ExpertCache] = []
        self._buffers = None

    def nbytes(self, cache: ExpertCache) -> int:
        return 0 if self.device.type != "cuda" else 2 * cache.expert_bytes * cache.num_experts

    def layer(self, cache: ExpertCache) -> tuple[QuantizedTensor, QuantizedTensor]:
        if self.device.type != "cuda":
            return cache.store.layer()
        if self._buffers is None:
            self._buffers = [tuple(_empty_like(q, cache.num_experts, self.device) for q in cache.experts)
                             for _ in range(2)]
            self._stream = torch.cuda.Stream(self.device)
            self._ready = [torch.cuda.Event() for _ in range(2)]
            self._free = [torch.cuda.Event() for _ in range(2)]
            self._held = [None, None]
        i = cache.index
        b = self._held.index(i) if i in self._held else self._load(i, 1 - self._held.index(i - 1)
                                                                   if i - 1 in self._held else 0)
        torch.cuda.current_stream(self.device).wait_event(self._ready[b])
        if i + 1 < len(self.caches) and i + 1 not in self._held:  # prefetch the next layer into the other buffer
            self._load(i + 1, 1 - b)
        return self._buffers[b]

    def _load(self, i: int, b: int) -> int:
        """Copy layer i's experts into buffer b on the side stream, once the kernels enqueued so far (those that
        read b) are done."""
        self._free[b].record(torch.cuda.current_stream(self.device))
        store = self.caches[i].store
        layer = store.layer() if store.in_place else store.layer(pinned=True)  # a disk store reads it now
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._free[b])
            for src, dst in zip(_parts(*layer), _parts(*self._buffers[b])):
                dst.copy_(src, non_blocking=True)
            self._ready[b].record(self._stream)
        self._held[b] = i
        return b
