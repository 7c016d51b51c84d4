"""Starting a tensor-parallel model: `start(size, load_args)` (what `sluice.load(..., tensor_parallel=N)` calls) makes
this process rank 0 and starts ranks 1..N-1 as worker processes (fresh interpreters, so CUDA is initialized per
rank, with this process's environment: NCCL settings included), all joined in one torch.distributed group over TCP
on this host (gloo on the CPU, NCCL on GPUs, rank r on cuda:r). Each rank loads its own shard; a worker then serves
rank 0's commands (`mirror.serve`) over a socket pair until rank 0 stops it or goes away (the connection closes;
on Linux the worker also gets SIGTERM when rank 0's process ends).

Under `torchrun` (its RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment), nothing is
started: every process torchrun started runs the same command, joins the group torchrun describes (rank r on
cuda:LOCAL_RANK, so one node or several), loads its shard, learns whether every rank did (any rank's error is raised
on all), and connects to rank 0 over TCP (an authenticated `multiprocessing.connection`, its address and key
broadcast over the group; loopback when the ranks share one node); `load` returns on rank 0 alone, and the other
ranks serve it, then exit when it closes.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import traceback

import torch

from sluice.errors import InvalidOptionError, SluiceError
from sluice.parallel import TensorParallel

LOADING: TensorParallel | None = None  # this process's rank while its shard of a tensor-parallel model loads
TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("SLUICE_TP_TIMEOUT", "300")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) of a process `torchrun` started (read from its environment), else None."""
    env = os.environ
    if not all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])


def _device(device, rank: int):
    """The device of the rank whose index on its host is `rank`: cuda:rank for a GPU, the CPU as it is."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if torch.cuda.device_count() <= rank:
            raise InvalidOptionError(f"tensor_parallel needs a GPU per rank; rank {rank} has none "
                                     f"({torch.cuda.device_count()} visible).")
        return torch.device("cuda", rank)
    return dev


def _join(rank: int, size: int, port: int | None, dev: torch.device, expert_parallel: bool) -> TensorParallel:
    """Join the group: on this host at `port`, or (None) where torchrun's environment says."""
    import torch.distributed as dist

    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    elif "OMP_NUM_THREADS" not in os.environ:  # CPU ranks share the host's cores: each takes its share, not all
        torch.set_num_threads(max(1, torch.get_num_threads() // size))
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size, timeout=TIMEOUT)
    return TensorParallel(rank, size, dist.group.WORLD, expert_parallel)


def _worker() -> None:
    """A worker rank (`python -m sluice.parallel.launch FD`: FD its end of a socket pair with rank 0): takes its rank
    and the load arguments, says it is about to join (or why it cannot), joins the group, loads its shard, serves."""
    global LOADING
    import sys
    from multiprocessing.connection import Connection

    from sluice.engine.loader import load
    from sluice.parallel.mirror import serve

    conn = Connection(int(sys.argv[1]))
    rank, size, group_port, load_args = conn.recv()
    try:
        dev = _device(load_args.get("device"), rank)
        conn.send(("joining", None))
        LOADING = _join(rank, size, group_port, dev, bool(load_args.get("expert_parallel")))
        model = load(**{**load_args, "device": dev})
        LOADING = None
    except BaseException as e:  # noqa: BLE001  said to rank 0, which raises it
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    conn.send(("loaded", None))
    serve(conn, model)


def _die_with_parent() -> None:
    """In a worker before it runs (Linux): SIGTERM when rank 0's process ends, however it ends."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _expect(conn, proc, want: str, rank: int):
    """The next message of worker `rank`, which must be `want`; its error (or its end) as a SluiceError."""
    try:
        kind, why = conn.recv()
    except (EOFError, OSError):
        raise SluiceError(f"tensor_parallel: rank {rank} ended before it {want} (exit status {proc.wait()}); its "
                          "error is above.") from None
    if kind != want:
        raise SluiceError(f"tensor_parallel: {why.splitlines()[0]}")


def start(size: int, load_args: dict):
    """A Model on rank 0 whose engine runs with `size - 1` worker processes in lockstep (`parallel/mirror.py`).
    Workers are plain `python -m` processes (not multiprocessing's spawn, which imports the caller's script again:
    a script calling `sluice.load` at its top level would start itself over), in a session of their own (a Ctrl-C
    at the terminal reaches rank 0 alone), ended with rank 0's process."""
    global LOADING
    import atexit
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection

    import torch.distributed as dist

    from sluice.engine.loader import load
    from sluice.parallel.mirror import Mirror

    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise InvalidOptionError(f"tensor_parallel={size!r}: use a positive integer.")
    if torchrun() is not None:
        return _start_under_torchrun(size, load_args)
    if dist.is_initialized():
        raise InvalidOptionError("a tensor-parallel model (or another torch.distributed group) is already running in "
                                 "this process; close() it first.")
    dev = _device(load_args.get("device"), 0)
    _device(load_args.get("device"), size - 1)  # every rank has its GPU, said before anything starts
    group_port, conns, procs = _free_port(), [], []
    mirror = Mirror(conns, procs)
    mirror.threads = torch.get_num_threads()  # `_join` may take a share of them on the CPU: close gives them back
    try:
        for rank in range(1, size):
            mine, theirs = socket.socketpair()
            p = subprocess.Popen([sys.executable, "-m", "sluice.parallel.launch", str(theirs.fileno())],
                                 pass_fds=(theirs.fileno(),), start_new_session=True, preexec_fn=_die_with_parent)
            theirs.close()
            procs.append(p)
            conn = Connection(mine.detach())
            conn.send((rank, size, group_port, load_args))
            conns.append(conn)
        for rank, (conn, p) in enumerate(zip(conns, procs), 1):
            _expect(conn, p, "joining", rank)
        LOADING = _join(0, size, group_port, dev, bool(load_args.get("expert_parallel")))
        try:
            model = load(**{**load_args, "device": dev})
        finally:
            LOADING = None
        for rank, (conn, p) in enumerate(zip(conns, procs), 1):
            _expect(conn, p, "loaded", rank)
    except BaseException:
        mirror.close()
        raise
    atexit.register(mirror.close)  # the workers stop with this process
    model.mirror = mirror
    return model


def _start_under_torchrun(size: int, load_args: dict):
    """`start` in a process torchrun started: join its group, load this rank's shard, learn whether every rank
    loaded (an error on any is raised on all); rank 0 accepts the others' connections and returns its Model; any
    other rank serves rank 0 until it stops, then exits."""
    global LOADING
    import socket
    import sys
    from multiprocessing.connection import Client

    import torch.distributed as dist

    from sluice.engine.loader import load
    from sluice.parallel.mirror import Mirror, serve

    rank, world, local = torchrun()
    if world != size:
        raise InvalidOptionError(f"tensor_parallel={size}, but torchrun started {world} processes; give "
                                 "--tensor-parallel the number of processes torchrun starts (nodes x processes each).")
    if dist.is_initialized():
        raise InvalidOptionError("torch.distributed is already initialized in this process; under torchrun "
                                 "sluice.load joins torchrun's group itself.")
    # a launcher that shows each process its one GPU (CUDA_VISIBLE_DEVICES) puts it at index 0
    dev = _device(load_args.get("device"), local if torch.cuda.device_count() > 1 else 0)
    LOADING = _join(rank, size, None, dev, bool(load_args.get("expert_parallel")))
    model, error = None, None
    try:
        model = load(**{**load_args, "device": dev})
    except Exception as e:  # noqa: BLE001  said to every rank below, raised on all
        error = f"rank {rank}: {type(e).__name__}: {e}"
    finally:
        LOADING = None
    errors = [None] * size
    dist.all_gather_object(errors, error)
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        dist.destroy_process_group()
        raise SluiceError(f"tensor_parallel: {failed}")
    one_node = int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world
    server, where = None, [None]
    if rank == 0:  # rank 0's command address: loopback on one node, every interface when ranks are elsewhere
        key = os.urandom(32)
        server = socket.create_server(("127.0.0.1" if one_node else "0.0.0.0", 0), backlog=size)
        server.settimeout(TIMEOUT.total_seconds())
        where = [("127.0.0.1" if one_node else os.environ["MASTER_ADDR"], server.getsockname()[1], key)]
    dist.broadcast_object_list(where, src=0)
    host, port, key = where[0]
    if rank != 0:
        with Client((host, port), authkey=key) as conn:
            serve(conn, model)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(0)
    with server:
        conns = _accept(server, key, size - 1)
    mirror = Mirror(conns, [])
    import atexit

    atexit.register(mirror.close)
    model.mirror = mirror
    return model


def _accept(server, key: bytes, n: int, handshake_s: float = 30.0) -> list:
    """n authenticated connections from `server` (a listening socket with a timeout): multiprocessing's handshake,
    as `Listener.accept` runs it, each within `handshake_s`; a connection that fails it (no key, or silence) is
    dropped and the next one awaited. SluiceError when the server's timeout passes first."""
    import socket
    import struct
    from multiprocessing.connection import AuthenticationError, Connection, answer_challenge, deliver_challenge

    def receive_timeout(sock, seconds: float) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(seconds), 0))

    conns = []
    while len(conns) < n:
        try:
            sock, _ = server.accept()
        except TimeoutError:
            raise SluiceError(f"tensor_parallel: {n - len(conns)} rank(s) did not connect to rank 0 within "
                              f"{server.gettimeout():.0f} s (SLUICE_TP_TIMEOUT).") from None
        receive_timeout(sock, handshake_s)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
        except (AuthenticationError, EOFError, OSError):
            conn.close()
            continue
        with socket.socket(fileno=os.dup(conn.fileno())) as same:  # the commands that follow wait as long as need be
            receive_timeout(same, 0)
        conns.append(conn)
    return conns


if __name__ == "__main__":  # run as a script, this file is `__main__`: the worker sets the importable module's rank
    from sluice.parallel import launch

    launch._worker()
