"""Where one MoE layer's routed experts are kept off the device: `HostStore` (stacked tensors in host memory,
page-locked on CUDA so kernels read them in place) or `DiskStore` (the checkpoint's safetensors files, read with
parallel `pread`s when an expert is missed; the OS page cache is the only host-side cache, so the model never has to
fit in host RAM).

Both hand out a whole layer (`layer()`: gate_up [E, 2I, ...] and down [E, H, ...] QuantizedTensors in host memory)
and copy missed experts into device slots (`fill(missed, victims, slots)`, host-driven: the slot ids must be known
on the host). The in-graph fill (`kernels/expert_cache`) needs a `HostStore`."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from sluice.kernels.expert_cache import reference
from sluice.quant.affine import QuantizedTensor

READ_THREADS = 16  # parallel preads: NVMe drives need many requests in flight
_POOL: ThreadPoolExecutor | None = None


def _readers() -> ThreadPoolExecutor:
    """The threads every disk store reads with (made once: a decode step reads in every MoE layer)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="sluice-expert-read")
    return _POOL


def parts(gate_up: QuantizedTensor, down: QuantizedTensor) -> list[torch.Tensor]:
    """The six tensors of a layer's experts, in slot-part order."""
    return [gate_up.weight, gate_up.scales, gate_up.biases, down.weight, down.scales, down.biases]


class HostStore:
    def __init__(self, gate_up: QuantizedTensor, down: QuantizedTensor):
        self.gate_up, self.down = gate_up, down
        self.in_place = True  # kernels may read it directly (page-locked, or the CPU's own memory)

    def layer(self) -> tuple[QuantizedTensor, QuantizedTensor]:
        return self.gate_up, self.down

    def fill(self, missed, victims, slots: list[torch.Tensor]) -> None:
        reference.fill(parts(self.gate_up, self.down), slots, torch.as_tensor(missed, dtype=torch.long),
                       torch.as_tensor(victims, dtype=torch.long))


@dataclass(frozen=True)
class FilePiece:
    """Rows [row0, row0 + rows) of every expert's slot part `part` are stored in `file` as a stacked [E, rows, ...]
    tensor starting at byte `start`, `nbytes` bytes an expert."""

    part: int
    row0: int
    file: Path
    start: int
    nbytes: int
    shape: tuple[int, ...]  # one expert's rows
    dtype: torch.dtype


class DiskStore:
    """A layer's experts in the checkpoint's files: `pieces` say where each slot part's rows lie (MLX checkpoints
    keep gate, up and down apart, each with weight, scales, biases: nine pieces for six parts)."""

    def __init__(self, pieces: list[FilePiece], experts: tuple[QuantizedTensor, QuantizedTensor], fds: dict):
        """experts: the layer's gate_up and down as meta tensors (their shapes, dtypes, bits); fds: path -> open
        file, shared by the layers (opened here, on the loading thread, so the reader threads only read the dict)."""
        self.pieces, self.experts = pieces, experts
        self.in_place = False
        for p in pieces:
            if p.file not in fds:
                fds[p.file] = os.open(p.file, os.O_RDONLY)
        self._fds = fds
        self.bytes_read = 0

    def _read(self, jobs: list[tuple[FilePiece, int, memoryview]]) -> None:
        """pread each (piece, expert, destination) in parallel threads (os.preadv lets go of the GIL)."""
        def one(job):
            piece, e, dst = job
            done, offset = 0, piece.start + e * piece.nbytes
            while done < piece.nbytes:
                n = os.preadv(self._fds[piece.file], [dst[done:]], offset + done)
                if n <= 0:
                    raise OSError(f"{piece.file}: short read at byte {offset + done}")
                done += n

        list(_readers().map(one, jobs))
        self.bytes_read += sum(p.nbytes for p, _, _ in jobs)

    def layer(self, pinned: bool = False) -> tuple[QuantizedTensor, QuantizedTensor]:
        """The whole layer read into fresh host memory (page-locked when `pinned`), as gate_up and down."""
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in parts(*self.experts)]
        jobs = [(p, e, _bytes(out[p.part][e, p.row0:p.row0 + p.shape[0]]))  # an expert's rows are contiguous
                for p in self.pieces for e in range(out[0].shape[0])]
        self._read(jobs)
        return tuple(QuantizedTensor(*out[i:i + 3], q.bits, q.group_size) for i, q in zip((0, 3), self.experts))

    def fill(self, missed, victims, slots: list[torch.Tensor]) -> None:
        """Read the missed experts into page-locked staging (parallel preads), then copy each piece into its slot
        rows asynchronously."""
        if not len(missed):
            return
        pinned = slots[0].is_cuda
        per_expert = sum(p.nbytes for p in self.pieces)
        buf = torch.empty(len(missed) * per_expert, dtype=torch.uint8, pin_memory=pinned)
        jobs, copies, at = [], [], 0
        for e, s in zip(missed, victims):
            for p in self.pieces:
                view = buf[at:at + p.nbytes]
                jobs.append((p, int(e), _bytes(view)))
                copies.append((slots[p.part][int(s), p.row0:p.row0 + p.shape[0]], view.view(p.dtype).view(p.shape)))
                at += p.nbytes
        self._read(jobs)
        for dst, src in copies:
            dst.copy_(src, non_blocking=pinned)


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    if not t.is_contiguous():
        raise ValueError("expert store: a piece's destination must be contiguous")
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")
