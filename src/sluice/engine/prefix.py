"""The prefix cache: a request whose prompt begins with what an earlier one left in the cache starts from there
instead of prefilling it again (a chat's next turn, an agent's next call, many users behind one system prompt).

The scheduler takes and gives back cache rows through a `PrefixCache`. When a sequence ends, its row is not wiped:
it stays, as an entry, with the ids whose keys and values it holds (prompt and output, as far as they were fed) and
its row state after the last of them (`CachePool.row_state`: Gated DeltaNet's recurrent and conv states, a
TurboQuant cache's exact ring of the newest positions). A sequence also leaves snapshots: its row state where its
prompt ended, copied into a slot apart (`CachePool.state_slots`), since the row's moves on as it decodes. A new
request is matched against every entry (its longest common prefix); it can resume at position r where both the KV
and the row state are known:
- a dense or latent KV cache and no recurrent layers (Llama, DeepSeek): any r up to the common prefix;
- else: the entry's end (its whole ids a prefix of the prompt: a chat turn after the one before) or a snapshot
  within the common prefix (a prompt that shares an earlier turn's prompt, then differs; or its system prompt: a
  request may name snapshot points, `Engine.add_request(snapshot_at=)`, where its prefill chunks end and the row
  state is kept, and a request that shares the prompt up to a point another running prompt has not reached yet waits
  for it, `awaits`).
r stays below the prompt's length: the last prompt token is always computed, for its logits. The new row gets the
entry's first r positions of KV and the states at r and prefills from r; with no free row left it takes the entry's
row itself. With a paged KV cache (`cache/blocks.py`) the entry's whole blocks are shared, not copied (a partial last
block is; a row taken over makes its own copy of a shared block it will write into). Entries and snapshots give way
least recently used first: an entry whenever a request needs a row or KV blocks and none are free, a snapshot when a
slot is needed.

Paged KV blocks are handed out here too: `fits` (whether a waiting request's prompt finds the blocks it needs, free
or held only by cached prefixes), `reserve` (the blocks a step's tokens need, entries evicted for them).

Not yet (issue #41): sliding-window caches, snapshots at chunk boundaries, and a prompt sent again whole on a model
with row state (its state one token before the end is never kept).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

# snapshot slots take at most this share of the KV cache's bytes (and at least two slots, at most one a row)
SNAPSHOT_SHARE = 0.1
HASH_BLOCK = 256  # ids are compared by chained hashes of blocks of this many (`block_hashes`), then one by one


def block_hashes(ids: list[int]) -> list[int]:
    """Chained hashes of the whole blocks of `ids`: the k-th stands for ids[:(k + 1) * HASH_BLOCK], so two id lists
    agree up to block k exactly where their k-th hashes do (up to a collision, which `_match` rules out by comparing
    the winner's ids)."""
    out, h = [], 0
    for k in range(len(ids) // HASH_BLOCK):
        h = hash((h, tuple(ids[k * HASH_BLOCK:(k + 1) * HASH_BLOCK])))
        out.append(h)
    return out


def common_prefix(a: list[int], b: list[int], ha: list[int], hb: list[int]) -> int:
    """The length of the common prefix of id lists a and b, with their `block_hashes`: a binary search over the
    blocks (O(log n) hash compares), then the ids of one block."""
    lo, hi = 0, min(len(ha), len(hb))  # blocks known equal, blocks that may be
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ha[mid - 1] == hb[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    start = lo * HASH_BLOCK
    end = min(len(a), len(b), start + HASH_BLOCK)
    return next((i for i in range(start, end) if a[i] != b[i]), end)


@dataclass
class _Entry:
    row: int
    ids: list[int]  # the ids whose keys and values the row holds, positions 0..n-1
    hashes: list[int]  # their `block_hashes`
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (position p, slot): the states after ids[:p]
    used: int = 0  # the last time it was inserted or hit (least recently used gives way first)


@dataclass
class PrefixStats:
    requests: int = 0  # requests admitted with the cache on
    hits: int = 0  # ... that resumed from a cached prefix
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not prefilled

    def as_dict(self) -> dict:
        return {"requests": self.requests, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0}


class PrefixCache:
    """The rows of one `CachePool` as the scheduler sees them (`allocate`, `release`, `free_rows`, `capacity`), with
    the cached prefixes kept in the rows no sequence holds. `enabled` False: a plain row allocator."""

    def __init__(self, pool, enabled: bool = True, batch: int | None = None, room: int | None = None):
        self.pool = pool
        self.batch = pool.rows if batch is None else batch  # sequences that may run at once; the other rows only
        # hold cached prefixes
        self.enabled = enabled and pool.resumable
        self.blocks = pool.blocks  # a paged KV cache's `BlockTable`, or None
        self.stateful = bool(pool.row_state())  # resumes only where the row state is known
        self.snapshot_bytes = 0
        self.entries: list[_Entry] = []
        self.stats = PrefixStats()
        self._clock = itertools.count(1)
        self.snapshots, self._free_slots = None, []
        if self.enabled and self.stateful:
            per = pool.state_bytes()
            kv = pool.nbytes() - per * (pool.rows + 1)
            n = max(2, min(pool.rows, int(SNAPSHOT_SHARE * kv / per)))
            if room is not None:  # the bytes the memory plan leaves (`engine/memory.py`)
                n = min(n, room // per)
            try:
                self.snapshots = pool.state_slots(n) if n > 0 else None
                self._free_slots = list(range(n - 1, -1, -1))
                self.snapshot_bytes = max(0, n) * per
            except torch.OutOfMemoryError:
                self.snapshots = None

    # -- what the scheduler uses ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def free_rows(self) -> int:
        """Rows a new sequence may take: the free ones and those only a cached prefix holds."""
        return self.pool.free_rows + len(self.entries)

    def allocate(self, seq, running=()) -> int:
        """A row for `seq`; where its ids begin with a cached prefix the row holds it (and seq.cached says how many
        positions: its prefill starts there). `running`: the sequences holding rows, whose snapshots count too."""
        seq.cached, seq.snapshots = 0, []
        ids = seq.prefill_ids
        hit = self._match(ids, running) if self.enabled and not seq.isolated else None
        if self.enabled and not seq.isolated:
            self.stats.requests += 1
            self.stats.prompt_tokens += len(ids)
        if hit is not None and self.blocks is not None and hit[1] % self.blocks.page and \
                not self.make_room(1, keep=hit[3]):  # no block for the partial last block's copy
            if self.stateful:  # the row state is known at r only
                hit = None
            else:  # whole blocks only: the rest is prefilled again
                r = hit[1] - hit[1] % self.blocks.page
                hit = (*hit[:1], r, *hit[2:]) if r else None
        if hit is not None and (self.pool.free_rows or hit[3] is None):  # copied into a row of its own
            src, r, slot, entry = hit
            row = self.pool.allocate() if self.pool.free_rows else self._evict_lru(keep=entry)
            self.pool.copy_prefix(src, row, r)
            self._restore_states(src, slot, row)
            if entry is not None:
                entry.used = next(self._clock)
        elif hit is not None:  # no row free: the sequence takes the entry's row itself
            src, r, slot, entry = hit
            self.entries.remove(entry)
            row = entry.row
            self._restore_states(src, slot, row)
            if self.blocks is not None:  # its positions from r on are written again: blocks of its own there
                if not self.blocks.truncate(row, r, self.pool.kv.copy_block):  # (a block was made free above)
                    raise RuntimeError("no free KV block to take a cached prefix's row over")
            # the row's first r positions stay: snapshots within them still hold, and go with the sequence
            seq.snapshots = [(p, s) for p, s in entry.snapshots if p <= r]
            self._free_slots += [s for p, s in entry.snapshots if p > r]
        else:
            row = self.pool.allocate() if self.pool.free_rows else self._evict_lru()
        if hit is not None:
            seq.cached = hit[1]
            self.stats.hits += 1
            self.stats.cached_tokens += hit[1]
        # points still ahead; none where any position is resumable or nothing is kept
        seq.snapshot_at = tuple(p for p in seq.snapshot_at if p > seq.cached) if self.enabled and self.stateful else ()
        return row

    def awaits(self, seq, running) -> bool:
        """Whether `seq` should wait to be admitted: a running prompt that shares seq's ids up to one of its snapshot
        points, and has not reached it yet, will leave the row state there within a few steps, and seq could resume
        from it (many clients sending one system prompt at once prefill it once)."""
        if not (self.enabled and self.stateful) or self.snapshots is None or seq.isolated:
            return False
        ids = seq.prefill_ids
        for other in running:
            for p in other.snapshot_at:
                if other.prefilled < p < len(ids) and other.prefill_ids[:p] == ids[:p]:
                    hit = self._match(ids, running)
                    return hit is None or hit[1] < p
        return False

    def fits(self, seq, running=()) -> bool:
        """Whether a waiting sequence's prompt finds the KV blocks it needs (past a cached prefix it would resume
        from), free or held by cached prefixes alone (their every holder an entry); always with an unpaged cache, and
        when nothing runs (every entry can then give way: a pool holds at least one longest sequence)."""
        if self.blocks is None or not running:
            return True
        ids = seq.prefill_ids
        hit = self._match(ids, running) if self.enabled and not seq.isolated else None
        need = self.blocks.blocks_for(len(ids)) - (0 if hit is None else hit[1] // self.blocks.page)
        if need <= self.blocks.free_blocks:
            return True
        holders: dict[int, int] = {}
        for e in self.entries:
            for b in self.blocks.owned[e.row]:
                holders[b] = holders.get(b, 0) + 1
        freeable = sum(n == self.blocks.refs.get(b) for b, n in holders.items())
        return need <= self.blocks.free_blocks + freeable

    def reserve(self, seq, positions: int) -> bool:
        """Give seq's row the KV blocks for its positions 0..positions-1 (a paged cache), cached prefixes evicted
        for them if need be; False if even that leaves too few."""
        if self.blocks is None:
            return True
        need = self.blocks.needs(seq.row, positions)
        return need == 0 or (self.make_room(need) and self.blocks.ensure(seq.row, positions))

    def make_room(self, blocks: int, keep=None) -> bool:
        """Evict cached prefixes, least recently used first (never `keep`), until `blocks` KV blocks are free."""
        while self.blocks.free_blocks < blocks:
            victims = [e for e in self.entries if e is not keep]
            if not victims:
                return False
            self.pool.release(self._evict(min(victims, key=lambda e: e.used)))
        return True

    def release(self, seq, keep: bool = True) -> None:
        """A sequence gives its row back: kept as an entry (keep, the cache on, something fed and known), else
        free."""
        ids = seq.fed_ids() if keep and self.enabled and seq.fed > 0 else None
        if ids is not None:
            self.entries.append(_Entry(seq.row, ids, block_hashes(ids), seq.snapshots, next(self._clock)))
        else:
            self._free_slots += [s for _, s in seq.snapshots]
            self.pool.release(seq.row)
        seq.snapshots = []

    def snapshot(self, seq, position: int) -> None:
        """Keep the row state of seq's row, which follows its first `position` ids (taken right after the step
        that fed them was launched: a copy on the device, in stream order)."""
        if self.snapshots is None or seq.isolated:
            return
        slot = self._slot()
        if slot is not None:
            self.pool.copy_state(seq.row, slot, dst_tensors=self.snapshots)
            seq.snapshots.append((position, slot))

    def clear(self) -> None:
        """Forget every cached prefix (their rows free) and the counters."""
        for entry in list(self.entries):
            self.pool.release(self._evict(entry))
        self.stats = PrefixStats()

    def take(self, old: "PrefixCache") -> None:
        """Carry the entries of another pool's cache over (a pool rebuilt bigger), most recent first, while rows and
        slots are free."""
        for entry in sorted(old.entries, key=lambda e: -e.used):
            if not self.pool.free_rows or len(entry.ids) > self.pool.capacity or (
                    self.blocks is not None and self.blocks.blocks_for(len(entry.ids)) > self.blocks.free_blocks):
                continue
            row = self.pool.allocate()
            old.pool.copy_prefix(entry.row, row, len(entry.ids), into=self.pool)
            snapshots = []
            if self.stateful:
                old.pool.copy_state(entry.row, row, dst_tensors=self.pool.row_state())
                for p, s in entry.snapshots:
                    slot = self._slot()
                    if slot is not None:
                        self.pool.copy_state(s, slot, old.snapshots, self.snapshots)
                        snapshots.append((p, slot))
            self.entries.append(_Entry(row, entry.ids, entry.hashes, snapshots, next(self._clock)))
        self.stats = old.stats

    # -- inside ---------------------------------------------------------------------------------------------
    def _match(self, ids: list[int], running=()):
        """(source row, r, snapshot slot or None, the entry or None: a running sequence's snapshot) of the longest
        resumable cached prefix of `ids`, or None."""
        if len(ids) < 2:
            return None
        best = None
        hashes = block_hashes(ids) if self.entries else None
        for entry in self.entries:
            n = len(entry.ids)
            common = common_prefix(entry.ids, ids, entry.hashes, hashes)
            r, slot = 0, None
            if not self.stateful:
                r = min(common, len(ids) - 1)
            elif common == n and n < len(ids):
                r = n  # the row's own state
            else:
                for p, s in entry.snapshots:
                    if r < p <= common and p < len(ids):
                        r, slot = p, s
            if r > 0 and (best is None or r > best[1]):
                best = (entry.row, r, slot, entry)
        if best is not None and best[3] is not None and best[3].ids[:best[1]] != ids[:best[1]]:
            best = None  # a hash collision: no hit rather than another prompt's cache
        for other in running if self.stateful else ():  # a running sequence's row moves on: its snapshots only
            for p, slot in other.snapshots:
                if (best is None or p > best[1]) and p < len(ids) and p <= other.fed \
                        and other.prefill_ids[:p] == ids[:p]:
                    best = (other.row, p, slot, None)
        return best

    def _restore_states(self, src: int, slot: int | None, row: int) -> None:
        if not self.stateful:
            return
        if slot is not None:
            self.pool.copy_state(slot, row, src_tensors=self.snapshots)
        elif row != src:
            self.pool.copy_state(src, row)

    def _evict_lru(self, keep=None) -> int:
        """The row of the least recently used entry (never `keep`), given up: its KV blocks given back, its state
        zeroed."""
        row = self._evict(min((e for e in self.entries if e is not keep), key=lambda e: e.used))
        self.pool.drop_kv(row)
        self.pool.reset(row)
        return row

    def _evict(self, entry: _Entry) -> int:
        self.entries.remove(entry)
        self._free_slots += [s for _, s in entry.snapshots]
        return entry.row

    def _slot(self) -> int | None:
        """A free snapshot slot, or the least recently used entry's oldest snapshot's; None if every slot is a
        running sequence's."""
        if self._free_slots:
            return self._free_slots.pop()
        for entry in sorted(self.entries, key=lambda e: e.used):
            if entry.snapshots:
                return entry.snapshots.pop(0)[1]
        return None
