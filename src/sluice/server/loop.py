"""The engine's own thread. The `Engine` is not thread-safe, so one thread owns it: request handlers (on the asyncio
loop) put requests and aborts into a thread-safe inbox; the thread adds them between steps (they join the running
batch), runs `engine.step()` while there is work, and hands each StepOutput to its request's asyncio queue through
`loop.call_soon_threadsafe`. No handler ever touches the engine or waits on a lock of the model."""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.engine import Engine, StepOutput
from sluice.engine.sequence import Sequence
from sluice.errors import SluiceError

log = logging.getLogger("sluice.server")
SLOW_STEP_S = 1.0  # a step longer than this is logged (a warning): something compiled, captured or stalled


class EngineFailure(RuntimeError):
    """A request the engine could not finish: engine.step() raised (status 500; the server keeps serving), or the
    server is shutting down (503)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


def shutting_down() -> EngineFailure:
    return EngineFailure("the server is shutting down; send the request again once it is back", 503)


@dataclass
class Submission:
    """A request on its way to the engine: add_request's arguments, and how to reach its handler."""

    prompt: list[int]
    options: dict[str, Any]
    deliver: Callable[[object], None]  # thread-safe: queue an item (a Sequence, a StepOutput, an error) for it
    seq: Sequence | None = None  # set by the engine thread once added


@dataclass
class Counters:
    requests: int = 0  # requests added to the engine
    finished: int = 0  # ended by a stop rule or max_tokens
    aborted: int = 0  # cancelled (the client went away) before they ended
    failed: int = 0  # ended by an engine error
    rejected: int = 0  # refused by add_request (bad options, too long)
    snapshot: dict = field(default_factory=dict)  # the engine's queues as of the last step


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.counters = Counters()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Submission] = {}  # sequence id -> its submission (engine thread only)
        self._closed = False  # stop() was called: no request is taken any more
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._publish()

    # -- the handlers' side (any thread; the async helpers on the asyncio loop) -------------------------------
    def start(self) -> None:
        """Build the cache pool (when its size is fixed: max_seq_len), capture the graphs and compile the kernels
        (`Engine.warmup`: before the server listens, so the first requests wait for none of it), and start the engine
        thread."""
        if self.engine.config.max_seq_len is not None:
            seconds = self.engine.warmup()
            print(f"sluice: engine ready in {seconds:.1f} s (cache pool, graphs, kernels)", file=sys.stderr, flush=True)
        if self.engine.runner.device.type == "cuda":  # from now on a compile is news: a slow step names it
            from sluice.kernels.launch import watch_compiles

            watch_compiles()
        self._publish()
        self._thread.start()

    def stop(self, timeout: float | None = 10) -> None:
        """End every request (a stream gets an error event and [DONE], a waiting reply a 503) and the thread."""
        self._closed = True
        if self._thread.is_alive():
            self._inbox.put(("stop", None))
            self._thread.join(timeout)

    def stats(self) -> dict:
        c = self.counters
        return {**c.snapshot, "requests": c.requests, "finished": c.finished, "aborted": c.aborted,
                "failed": c.failed, "rejected": c.rejected}

    async def open(self, prompt: list[int], **options) -> RequestStream:
        """Submit a request and wait until the engine has taken it: the errors add_request raises (SluiceError)
        come out here, before anything is sent to the client."""
        if self._closed:
            raise shutting_down()
        aloop, items = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(item):
            try:
                aloop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the event loop is gone (shutting down)
                pass

        sub = Submission(prompt, options, deliver)
        self._inbox.put(("add", sub))
        try:
            first = await items.get()
        except asyncio.CancelledError:
            self.abort(sub)
            raise
        if isinstance(first, BaseException):
            raise first
        return RequestStream(self, sub, first, items)

    def abort(self, sub: Submission) -> None:
        """Cancel a request (a no-op once it ended); its cache row is free for the next step."""
        self._inbox.put(("abort", sub))

    # -- the engine thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if not self._drain(block=not self.engine.has_work()):
                return
            if self.engine.has_work():
                self._step()
            self._publish()

    def _drain(self, block: bool) -> bool:
        """Take every queued message (waiting for one when the engine is idle); False once told to stop."""
        try:
            kind, sub = self._inbox.get(block=block)
            while True:
                if kind == "stop":
                    self._fail_all(shutting_down())
                    self._refuse_queued()
                    return False
                self._add(sub) if kind == "add" else self._abort(sub)
                kind, sub = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _refuse_queued(self) -> None:
        """Answer the requests still in the inbox (sent while the server began to stop)."""
        try:
            while True:
                kind, sub = self._inbox.get_nowait()
                if kind == "add":
                    sub.deliver(shutting_down())
        except queue.Empty:
            pass

    def _add(self, sub: Submission) -> None:
        try:
            seq = self.engine.add_request(sub.prompt, **sub.options)
        except SluiceError as e:
            self.counters.rejected += 1
            sub.deliver(e)
            return
        except Exception as e:  # a bug, not bad input: report it to this request only
            log.error("add_request failed:\n%s", traceback.format_exc())
            self.counters.rejected += 1
            sub.deliver(EngineFailure(f"{type(e).__name__}: {e}"))
            return
        sub.seq = seq
        self._live[seq.id] = sub
        self.counters.requests += 1
        sub.deliver(seq)

    def _abort(self, sub: Submission) -> None:
        seq = sub.seq
        if seq is not None and self._live.pop(seq.id, None) is not None and not seq.finished:
            self.engine.abort(seq)
            self.counters.aborted += 1

    def _step(self) -> None:
        t0 = time.perf_counter()
        runner = self.engine.runner
        captures, compiled = runner.captures, len(_compiled())
        try:
            outputs: list[StepOutput] = self.engine.step()
            seconds = time.perf_counter() - t0
            if seconds > SLOW_STEP_S:  # what it ran, and what it compiled or captured on the way
                sched = self.engine.scheduler
                new = _compiled()[compiled:]
                log.warning("a step took %.2f s (%d running, %d waiting): %s; %d graph(s) captured, %d kernel(s) "
                            "compiled%s; host seconds %s", seconds, len(sched.running), len(sched.waiting),
                            runner.describe_last(), runner.captures - captures, len(new),
                            f" ({', '.join(sorted(set(new)))})" if new else "",
                            ", ".join(f"{k} {v:.3f}" for k, v in self.engine.timing.items()))
        except Exception as e:
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._fail_all(EngineFailure(f"the engine failed: {type(e).__name__}: {e}"))
            return
        for out in outputs:
            sub = self._live.get(out.seq.id)
            if sub is None:
                continue
            if out.finished:
                del self._live[out.seq.id]
                if out.seq.finish_reason == "error":  # NaN/inf logits: this request fails, the others go on
                    self.counters.failed += 1
                    sub.deliver(EngineFailure(out.seq.error))
                    continue
                self.counters.finished += 1
            sub.deliver(out)

    def _fail_all(self, error: Exception) -> None:
        for sub in list(self._live.values()):
            try:
                self.engine.abort(sub.seq)
            except Exception:
                log.error("abort failed:\n%s", traceback.format_exc())
            self.counters.failed += 1
            sub.deliver(error)
        self._live.clear()

    def _publish(self) -> None:
        sched, rows = self.engine.scheduler, self.engine.rows
        self.counters.snapshot = {
            "running": len(sched.running), "waiting": len(sched.waiting),
            "cache_rows": rows.batch if rows is not None else 0,  # sequences that may run at once
            "cache_rows_free": min(rows.free_rows, rows.batch - len(sched.running)) if rows is not None else 0,
            "prefix_cache": None if rows is None or not rows.enabled else {
                "cached_prefixes": len(rows.entries), "rows": rows.pool.rows, **rows.stats.as_dict()},
            "kv_blocks": None if rows is None or rows.blocks is None else {  # a paged KV cache
                "page": rows.blocks.page, "blocks": rows.blocks.blocks, "free": rows.blocks.free_blocks,
                "preemptions": self.engine.preemptions}}


class RequestStream:
    """The handler's side of one request: its outputs as they come, and abort()."""

    def __init__(self, loop: EngineLoop, sub: Submission, seq: Sequence, items: asyncio.Queue):
        self.loop, self.sub, self.seq, self.items = loop, sub, seq, items

    async def __aiter__(self):
        while True:
            item = await self.items.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def abort(self) -> None:
        self.loop.abort(self.sub)


def _compiled() -> list[str]:
    """The Triton kernels compiled since the engine thread started watching (`kernels/launch.py`); [] without
    Triton or off a GPU."""
    launch = sys.modules.get("sluice.kernels.launch")
    return [] if launch is None else launch.COMPILED
