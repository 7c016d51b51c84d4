"""A step's sampled tokens on their way from the device to the host (the engine's sampling and read-back half).

`draw` samples one token per sequence on the device (each row's constraint applied first, `engine/sampler.py` for the
rest) and starts copying the ids, with a finite check of each row's logits, to the host; nothing waits. `land` waits
for that copy and gives each sequence still running its token (and its log probabilities where it asked for them);
the engine appends them (`Engine._land`). With overlap a drawn step is landed one `step()` later, after the next step
was launched on `decode_ids`: its decode tokens' ids taken from the drawn step's, still on the device. Nothing here
touches the scheduler or a sequence's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.engine.batch import on_device
from sluice.engine.sampler import SamplingBatch, mark_seen, output_counts, sample
from sluice.engine.sequence import Sequence


@dataclass
class Drawn:
    """A step's sampled ids on the device, and their copy on the way to the host."""
    seqs: list[Sequence]
    ids: torch.Tensor  # int64 [B] on the device: the next step's input when it runs ahead
    host: torch.Tensor  # int64 [2, B]: ids and finite flags (pinned on a GPU; valid once `ready` has passed)
    ready: torch.cuda.Event | None
    logits: torch.Tensor  # the raw logits (logprobs; read before the next step overwrites a graph's)


def draw(seqs: list[Sequence], logits: torch.Tensor, ahead: list[int], seen: torch.Tensor) -> Drawn:
    """Sample one token per sequence on the device and start copying the ids (with a finite check of each row's
    logits) to the host; nothing waits. `ahead`: per sequence, tokens it has drawn that are not in its output yet
    (the sampler's counters count them); `seen`: the repetition-penalty mask of the pool's rows, the drawn ids marked
    in it where a row needs it."""
    raw = logits
    if any(s.constraint is not None for s in seqs):
        logits = masked(seqs, logits)
    if all(s.sampling.plain_greedy for s in seqs):  # greedy
        ids = logits.argmax(-1)
    else:
        batch = SamplingBatch([s.sampling for s in seqs], [s.seed for s in seqs],
                              [len(s.output) + a for s, a in zip(seqs, ahead)], logits.device)
        rows = on_device([s.row for s in seqs], torch.long, logits.device) if batch.needs_seen else None
        counts = None
        if batch.needs_counts:
            counts = output_counts([s.output if s.sampling.counts_output else () for s in seqs],
                                   logits.shape[-1], logits.device)
        ids = sample(logits, batch, seen, rows, counts)
        if rows is not None:
            mark_seen(seen, rows, ids)
    # NaN/inf logits end that request: the check travels with the ids (one transfer)
    both = torch.stack([ids, torch.isfinite(raw).all(-1).to(ids.dtype)])
    gpu = both.is_cuda
    host = torch.empty(both.shape, dtype=both.dtype, pin_memory=gpu)
    host.copy_(both, non_blocking=gpu)
    ready = None
    if gpu:
        ready = torch.cuda.Event()
        ready.record()
    return Drawn(list(seqs), ids, host, ready, raw)


def land(drawn: Drawn) -> list[tuple[Sequence, int, bool, tuple]]:
    """Wait for a drawn step's ids: (sequence, token, whether its logits were finite, (logprob, top logprobs) where it
    asked for them, else ()) for each of its sequences not finished since (those aborted or stopped meanwhile are
    skipped: a step run ahead of a stop is thrown away)."""
    if drawn.ready is not None:
        drawn.ready.synchronize()
    ids, ok = drawn.host.tolist()
    live = [(i, s) for i, s in enumerate(drawn.seqs) if not s.finished]
    lps = logprobs([s for _, s in live], drawn.logits[[i for i, _ in live]],
                   drawn.ids[[i for i, _ in live]]) if any(s.logprobs is not None for _, s in live) else {}
    return [(s, ids[i], bool(ok[i]), lps.get(j, ())) for j, (i, s) in enumerate(live)]


def decode_ids(decodes: list[Sequence], ahead: Drawn | None):
    """The decode tokens' ids: host ints, or (a step run ahead) int64 [D] on the device: ahead's sampled ids where a
    sequence's last token is one of them, its newest output token elsewhere."""
    if ahead is None:
        return [s.output[-1] for s in decodes]
    where = {s.id: i for i, s in enumerate(ahead.seqs)}
    index = [where.get(s.id, -1) for s in decodes]
    if index == list(range(len(decodes))):
        return ahead.ids[:len(decodes)]
    host = on_device([index, [0 if i >= 0 else s.output[-1] for i, s in zip(index, decodes)]], torch.long,
                     ahead.ids.device)
    return torch.where(host[0] >= 0, ahead.ids[host[0].clamp(min=0)], host[1])


def masked(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """A copy of the logits with the tokens each row's constraint forbids at -inf."""
    logits = logits.clone()
    for i, s in enumerate(seqs):
        if s.constraint is not None:
            allowed = s.constraint.allowed().to(logits.device, non_blocking=True)
            logits[i].masked_fill_(~allowed, float("-inf"))
    return logits


def logprobs(seqs: list[Sequence], logits: torch.Tensor, ids: torch.Tensor) -> dict:
    """{row index: (logprob of the sampled token, [(id, logprob)] of the N likeliest)} for the rows that ask."""
    want = [i for i, s in enumerate(seqs) if s.logprobs is not None]
    if not want:
        return {}
    index = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = lp.gather(1, ids.index_select(0, index)[:, None])[:, 0].tolist()
    top = lp.topk(max(seqs[i].logprobs for i in want), dim=-1)
    values, indices = top.values.tolist(), top.indices.tolist()
    return {i: (chosen[j], list(zip(indices[j], values[j]))[:seqs[i].logprobs]) for j, i in enumerate(want)}
