"""Lockstep engines across tensor-parallel ranks.

Every rank runs a whole `Engine` over its shard of the model; the forwards' collectives (`sluice/parallel`) meet
because every rank runs the same steps with the same requests. Rank 0 is the one callers talk to: its
`MirroredEngine` records each request added and aborted (the seed drawn for it included, so every rank samples the
same tokens) and, before each step, sends them to the workers with the step (`Mirror.send`); a worker (`serve`) adds
and aborts the same and steps. The logits every rank samples from are the same (gathered from the vocabulary
shards), so every rank's scheduler, prefix cache and sampler decide alike, and nothing else needs sending.

Commands go over local connections (a worker whose rank 0 has gone away sees its connection close and exits); tensors
go over torch.distributed. What a worker runs: a step, a warm-up, the pool reserved, a full forward (`Model.logits`),
another engine over the same weights (`Model.with_engine`), stop.
"""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import time

from sluice.engine.engine import Engine
from sluice.errors import SluiceError, UnsupportedError


class Mirror:
    """Rank 0's ends of the workers' connections, and the workers' processes."""

    def __init__(self, conns, procs):
        self.conns, self.procs = conns, procs
        self._keys = 0
        self._dropped: list[int] = []  # engines of models gone, dropped on the workers with the next message
        self.closed = False
        self.threads: int | None = None  # rank 0's torch threads before it took its share (restored at close)

    def send(self, *message) -> None:
        if self.closed:
            raise SluiceError("this tensor-parallel model was closed; load it again.")
        messages = [("drop", key) for key in self._dropped] + [message]
        self._dropped = []
        data = [pickle.dumps(m) for m in messages]  # pickled once for every worker
        for conn in self.conns:
            for d in data:
                conn.send_bytes(d)

    def drop(self, key: int) -> None:
        """A model made by `with_engine` is gone: its engine on the workers goes too (with the next message)."""
        self._dropped.append(key)

    def new_key(self) -> int:
        self._keys += 1
        return self._keys

    def close(self) -> None:
        """Stop the workers and the process group. Idempotent. A worker waiting for its next command leaves its loop
        and exits at once; one that does not within 3 s (stuck in a collective of a step rank 0 left, a Ctrl-C
        mid-step) is terminated, then killed."""
        if self.closed:
            return
        self.closed = True
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(("stop",))
        for signal_them in (None, subprocess.Popen.terminate, subprocess.Popen.kill):
            deadline = time.monotonic() + 3
            for p in self.procs:
                if signal_them is not None and p.poll() is None:
                    signal_them(p)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if all(p.poll() is not None for p in self.procs):
                break
        self.conns, self.procs = [], []
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads is not None:  # the caller's process has its cores back
            import torch

            torch.set_num_threads(self.threads)


class MirroredEngine(Engine):
    """Rank 0's engine: an `Engine` that sends what its steps need to the workers' engines (engine `key`)."""

    def __init__(self, *args, mirror: Mirror, key: int):
        super().__init__(*args)
        self.mirror, self.key = mirror, key
        self._pending: list[tuple] = []  # requests added and aborted since the last step
        self._inside = 0  # >0 while a warm-up or a reserve runs: its own steps are the workers' too

    def add_request(self, prompt, max_tokens: int = 256, **kwargs):
        if kwargs.get("constraint") is not None:
            raise UnsupportedError("a constrained request (a grammar, a forced tool call) is not supported with "
                                   "tensor_parallel yet.")
        seq = super().add_request(prompt, max_tokens, **kwargs)
        if not self._inside:
            self._pending.append(("add", seq.id, seq.prompt, max_tokens, {**kwargs, "seed": seq.seed}))
        return seq

    def abort(self, seq) -> None:
        super().abort(seq)
        if not self._inside:
            self._pending.append(("abort", seq.id))

    def _send(self, what: str) -> None:
        """`what` for the workers' engine, after the requests added and aborted since the last message."""
        pending, self._pending = self._pending, []
        self.mirror.send(what, self.key, pending)

    def step(self):
        if not self._inside:
            self._send("step")
        return super().step()

    @contextlib.contextmanager
    def _together(self, what: str):
        """`what` run on every rank at once (its steps inside it not sent one by one, nor what it runs in turn)."""
        if not self._inside:
            self._send(what)
        self._inside += 1
        try:
            yield
        finally:
            self._inside -= 1

    def warmup(self) -> float:
        with self._together("warmup"):
            return super().warmup()

    def reserve(self) -> None:
        with self._together("reserve"):
            super().reserve()

    def clear_prefixes(self) -> None:
        with self._together("clear_prefixes"):
            super().clear_prefixes()

    def memory_plan(self, make: bool = True) -> dict:
        if self.runner.pool is not None or not make:  # the pool's plan, or nothing: no device work
            return super().memory_plan(make)
        with self._together("memory_plan"):  # planning may run a profile step: every rank plans
            return super().memory_plan(make)


def serve(conn, model) -> None:
    """A worker's loop: rank 0's commands on `model` (engine key 0) and the engines made from it, until "stop" or
    the connection closes."""
    models, seqs = {0: model}, {}
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        kind, args = message[0], message[1:]
        if kind == "stop":
            return
        if kind == "with_engine":
            parent, key, options = args
            models[key] = models[parent].with_engine(**options)
        elif kind == "drop":
            models.pop(args[0], None)
        elif kind == "logits":
            models[args[0]].logits(args[1])  # (checked on rank 0 before it was sent)
        elif kind in ("step", "warmup", "reserve", "memory_plan", "clear_prefixes"):
            key, pending = args
            engine = models[key].engine
            for op in pending:  # first what rank 0 did to the requests since its last message
                if op[0] == "add":
                    _, rid, prompt, max_tokens, kwargs = op
                    seqs[key, rid] = engine.add_request(prompt, max_tokens, **kwargs)
                else:
                    seq = seqs.pop((key, op[1]), None)
                    if seq is not None:
                        engine.abort(seq)
            try:
                getattr(engine, kind)()
            except SluiceError:  # the same state fails alike on rank 0, which raises it there: the worker goes on
                pass
            for k in [k for k, s in seqs.items() if s.finished]:
                del seqs[k]
