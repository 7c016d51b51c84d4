"""Tensor parallelism (issue #44): a model's weights split across N ranks (processes), one per GPU (or per rank on
the CPU, over gloo), Megatron's way:

* column-parallel (`TensorParallel.col`): a weight's output rows split, each rank computes its slice of the output
  (q, k, v and gate/up projections: whole attention heads, whole slices of the MLP);
* row-parallel (`row`, then `RowParallel`): a weight's input columns split, each rank's partial product summed by one
  all-reduce (the attention's and the MLP's output projections), so a layer costs two all-reduces;
* vocabulary-parallel: the embedding's rows split (`VocabEmbedding`: each rank looks up the ids it holds, one
  all-reduce), the output head's rows split (`VocabHead`: each rank's logits, one all-gather).

Norms, RoPE tables and the KV cache layout stay per rank: each rank's attention holds its own heads' K/V, so a rank's
cache pool is 1/N of the model's. Quantized (MLX-affine) weights split on their packed words and groups: a
row-parallel split needs each rank's input columns to be whole quantization groups.

Running: `sluice.load(..., tensor_parallel=N)` starts N - 1 worker processes (`parallel/launch.py`); every rank runs
the same engine in lockstep (`parallel/mirror.py`): rank 0 takes the requests and sends each step's new requests and
aborts to the others before the step, and since every rank sees the same logits (gathered), every rank's scheduler,
prefix cache and sampler make the same choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sluice.errors import UnsupportedError
from sluice.quant.affine import QuantizedTensor


@dataclass
class TensorParallel:
    """This process's place in a tensor-parallel group: `rank` of `size`, the torch.distributed group its
    collectives run on."""

    rank: int
    size: int
    group: object = None
    expert_parallel: bool = False  # routed experts split whole across the ranks (else each one's intermediate size)

    # -- splitting weights -----------------------------------------------------------------------------------
    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of n items split evenly; UnsupportedError when n does not split."""
        if n % self.size:
            raise UnsupportedError(f"tensor_parallel={self.size}: {what} ({n}) does not split into {self.size} "
                                   "equal parts; use a tensor_parallel size that divides it.")
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def col(self, w, what: str = "a weight's output rows", unit: int = 1):
        """Column-parallel: this rank's output rows of w [N, K] (dense or quantized), in whole units of `unit` rows
        (a head)."""
        a, b = self.split(w.shape[0] // unit, what)
        return _rows(w, a * unit, b * unit)

    def kv_heads(self, n: int) -> int:
        """KV heads a rank holds: its share, or one replicated head where the ranks outnumber them."""
        if n % self.size == 0:
            return n // self.size
        if self.size % n == 0:
            return 1
        raise UnsupportedError(f"tensor_parallel={self.size}: {n} KV heads neither split into {self.size} parts nor "
                               "replicate evenly; use a tensor_parallel size that divides them or a multiple of them.")

    def kv(self, w, n: int, head_dim: int):
        """This rank's KV heads of a k or v projection [n * head_dim, K]: its share, or where the ranks outnumber the
        heads the one its query heads read (head rank * n // size: a GQA group never spans two)."""
        if n % self.size == 0:
            return self.col(w, "KV heads", head_dim)
        self.kv_heads(n)
        h = self.rank * n // self.size
        return _rows(w, h * head_dim, (h + 1) * head_dim)

    def row(self, w, what: str = "a weight's input columns"):
        """Row-parallel: this rank's input columns of w [N, K]; quantized, whole groups of packed words."""
        if isinstance(w, QuantizedTensor):
            groups = w.scales.shape[-1]
            a, b = self.split(groups, f"{what}' quantization groups")
            words = w.weight.shape[-1] // groups
            return QuantizedTensor(w.weight[..., a * words:b * words].clone(), w.scales[..., a:b].clone(),
                                   w.biases[..., a:b].clone(), w.bits, w.group_size)
        a, b = self.split(w.shape[-1], what)
        return w[..., a:b].clone()

    def experts_to_read(self, n: int) -> range:
        """The routed experts (of n) whose weights this rank needs: its own under expert parallelism (a checkpoint
        of per-expert tensors is read for those alone), else all (each one's slice)."""
        return range(*self.split(n, "the routed experts")) if self.expert_parallel else range(n)

    def experts(self, gate_up, down, intermediate: int, read: range | None = None):
        """This rank's part of stacked experts gate_up [E, 2I, K] ([gate | up] rows) and down [E, H, I]. Tensor
        parallel: every expert's intermediate slice, gate_up rows a..b of each half, down columns a..b (its output a
        partial sum). Expert parallel: experts a..b whole, then one expert of zeros (`SparseMoE.hold`). read: the
        experts the stacks hold when the checkpoint was read for `experts_to_read` alone (None: all of them)."""
        if self.expert_parallel:
            if read is None:
                a, b = self.split(gate_up.shape[0], "the routed experts")
                gate_up, down = _rows(gate_up, a, b), _rows(down, a, b)
            return _with_zero_expert(gate_up), _with_zero_expert(down)
        a, b = self.split(intermediate, "the experts' intermediate size")
        I = intermediate
        if isinstance(gate_up, QuantizedTensor):
            rows = lambda t: torch.cat([t[:, a:b], t[:, I + a:I + b]], dim=1).contiguous()
            gate_up = QuantizedTensor(rows(gate_up.weight), rows(gate_up.scales), rows(gate_up.biases),
                                      gate_up.bits, gate_up.group_size)
        else:
            gate_up = torch.cat([gate_up[:, a:b], gate_up[:, I + a:I + b]], dim=1)
        return gate_up, self.row(down, "the experts' intermediate size")

    def expert_range(self, n: int) -> tuple[int, int]:
        """(first, count) of the n routed experts this rank holds under expert parallelism."""
        a, b = self.split(n, "the routed experts")
        return a, b - a

    def vocab(self, w):
        """This rank's rows of an embedding or output head [V, H], V padded up to a multiple of the size (the
        padding rows zero: logits there are cut off after the gather, ids never reach them)."""
        V = w.shape[0]
        part = -(-V // self.size)
        a, b = min(V, self.rank * part), min(V, (self.rank + 1) * part)
        return _rows(w, a, b, pad_to=part)

    # -- collectives ------------------------------------------------------------------------------------------
    def agree(self, value: int, op, device) -> int:
        """value as every rank takes it (op: min or max over the ranks): a decision each rank makes from its own
        readings (free memory, say) comes out the same on all, as lockstep needs."""
        import torch.distributed as dist

        device = torch.device(device)
        t = torch.tensor([int(value)], dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op is min else dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [..., n] side by side: [..., size * n] (rank order)."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def vocab_layers(embed, head, tie: bool, vocab: int, tp: TensorParallel | None):
    """(embedding, output head) of a model from the weights [V, H] `embed` and `head` (None when `tie`: the head is
    the embedding's storage); with `tp` this rank's vocabulary rows, the lookups summed and the logits gathered."""
    from sluice.layers.linear import Embedding, Linear

    embedding = Embedding(embed if tp is None else tp.vocab(embed))
    out = embedding.as_linear() if tie else Linear(head if tp is None else tp.vocab(head))
    if tp is None:
        return embedding, out
    return VocabEmbedding(embedding, tp, vocab), VocabHead(out, tp, vocab)


def _rows(w, a: int, b: int, pad_to: int | None = None):
    """Rows a..b-1 of a dense or quantized weight [N, K], zero rows after them up to `pad_to` rows."""
    if isinstance(w, QuantizedTensor):
        parts = [_rows(t, a, b, pad_to) for t in (w.weight, w.scales, w.biases)]
        return QuantizedTensor(*parts, w.bits, w.group_size)
    out = w[a:b]
    if pad_to is not None and b - a < pad_to:
        return torch.cat([out, out.new_zeros(pad_to - (b - a), *out.shape[1:])])
    return out.clone()  # its own storage: a view would keep the whole weight alive on every rank


def _with_zero_expert(w):
    """Stacked experts [E, N, K] (dense or quantized) and one more of zeros after them: quantized, zero codes, scales
    and biases, so it dequantizes to exact zeros."""
    if isinstance(w, QuantizedTensor):
        return QuantizedTensor(*(_with_zero_expert(t) for t in (w.weight, w.scales, w.biases)), w.bits, w.group_size)
    return torch.cat([w, w.new_zeros(1, *w.shape[1:])])


class RowParallel(nn.Module):
    """A row-parallel Linear: this rank's partial product, summed over the ranks (one all-reduce)."""

    def __init__(self, linear: nn.Module, tp: TensorParallel):
        super().__init__()
        self.linear, self.tp = linear, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x))


class VocabEmbedding(nn.Module):
    """An embedding whose rows are split by vocabulary: each rank looks up the ids in its rows (zero elsewhere),
    one all-reduce sums them."""

    def __init__(self, embedding: nn.Module, tp: TensorParallel, vocab: int):
        super().__init__()
        self.embedding, self.tp = embedding, tp
        self.part = -(-vocab // tp.size)
        self.start = tp.rank * self.part

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.part)
        h = self.embedding(torch.where(mine, local, torch.zeros_like(local)), dtype)
        return self.tp.all_reduce(h * mine[..., None].to(h.dtype))


class VocabHead(nn.Module):
    """An output head whose rows are split by vocabulary: each rank's logits, gathered (the padding cut off)."""

    def __init__(self, head: nn.Module, tp: TensorParallel, vocab: int):
        super().__init__()
        self.head, self.tp, self.vocab = head, tp, vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.head(x))[..., :self.vocab]
