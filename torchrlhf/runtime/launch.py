"""Start and stop the runtime: the default process group plus RPC, on every rank.

Under ``torchrun`` every rank calls `launch(main, *args)`: rank 0 runs
``main(*args)`` as the single controller (and serves RPC as a worker too), the
other ranks only serve RPC until the controller tells them to stop. Without
torchrun's environment (a notebook, a plain ``python`` call) the world is one
process on loopback (rendezvous through an in-memory store and a temp file).

Rendezvous: under torchrun's agent, the process group and RPC use torchrun's own
store (a hand-made ``tcp://`` store hangs under it), with their keys under a
prefix naming the restart attempt, so a job restarted by ``--max-restarts``
does not read the killed attempt's addresses. The ranks agree on that name in
the store (`agreed_attempt`): torchrun's restart count is per agent, and after
a restart across nodes the agents' counts differ (only the failed node's
agent counts the restart), so ranks naming the attempt by it waited apart.

Listening address: TensorPipe's socket transport (``uv``) and multiplexed
channel listen on one address, chosen once per process: the address of the
interface named by ``TP_SOCKET_IFNAME`` if set, else the address the host name
resolves to, else 127.0.0.1 (never the wildcard address). Gloo picks its
address the same way from ``GLOO_SOCKET_IFNAME``. Before initialising, we set
both variables (unless the user already did) to the interface that carries
traffic to ``MASTER_ADDR``: found by asking the kernel which source address it
would use to reach ``MASTER_ADDR`` and which interface owns it (Linux ioctl).
So by default RPC and gloo listen only on torchrun's network, and notebook mode
only on loopback. The ``shm`` transport and ``cma`` channel are local-only.
torchrun's own rendezvous store (a c10d TCPStore in the agent) is torchrun's:
it listens on all interfaces of the master node at MASTER_PORT. Notebook mode
opens no store socket at all (in-memory store for the process group, a temp
file for RPC). With RANK/WORLD_SIZE set but no torchrun agent store (a
hand-rolled launcher), the process group's store takes MASTER_PORT and RPC
rendezvous on MASTER_PORT + 1. RPC executes pickles sent by peers: the
cluster network must be trusted.

Shutdown never hangs: when ``main`` returns, the controller tells every rank to
stop, then all ranks run a graceful RPC shutdown bounded by ``shutdown_timeout``
(a rank that cannot finish in time exits with ``os._exit``). After the controller
gave up a dead rank (`mark_lost`: asynchronous training goes on without a dead
rollout rank) a graceful shutdown would wait for it, so every live rank then shuts
down locally: workers close their roles and exit at once. When ``main``
raises, the controller tells every rank to exit non-zero at once and re-raises.
Worker ranks also ping the controller every ``heartbeat_s`` and exit non-zero
if it is gone, so no rank outlives a dead controller.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn
from urllib.parse import parse_qsl, urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.constants import default_pg_timeout

from torchrlhf.runtime import compute_thread

DEFAULT_RPC_TIMEOUT = 1800.0  # a worker method may run long (a training step); a dead peer fails faster (EOF)
DEFAULT_SHUTDOWN_TIMEOUT = 10.0
DEFAULT_HEARTBEAT_S = 5.0
_SIOCGIFADDR = 0x8915

_stop_event = threading.Event()
_stop_code = 0
_stop_alone = False  # shut down without the other ranks (some rank was lost)
_lost: set[int] = set()  # ranks the controller gave up (`mark_lost`)
_state: dict[str, Any] = {"initialized": False, "notebook": False, "rpc_timeout": DEFAULT_RPC_TIMEOUT}
_on_finish: list[Callable[[], None]] = []  # forget per-run registries (workers, group names) at shutdown


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def is_initialized() -> bool:
    return _state["initialized"]


def rpc_timeout() -> float:
    """Default timeout (seconds) of controller calls; set by `init`."""
    return _state["rpc_timeout"]


# ---------------------------------------------------------------------- address binding
def _ipv4_of_interface(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_for(addr: str) -> str | None:
    """Name of the local interface whose address the kernel uses to reach ``addr`` (None if unknown)."""
    try:
        ip = socket.gethostbyname(addr)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # UDP connect sends nothing; it only picks the route
            local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            if _ipv4_of_interface(name) == local:
                return name
    except OSError:
        pass
    return None


def _bind_to_master_interface(master_addr: str) -> None:
    iface = interface_for(master_addr)
    if iface is None:
        warnings.warn(
            f"torchrlhf: could not find the interface that reaches MASTER_ADDR={master_addr!r}; "
            "RPC listens on the host name's address (set TP_SOCKET_IFNAME/GLOO_SOCKET_IFNAME to choose)"
        )
        return
    os.environ.setdefault("TP_SOCKET_IFNAME", iface)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)


# ---------------------------------------------------------------------- init / shutdown
_ATTEMPT_SCHEME = "torchrlhf-attempt"


def _attempt_store_rendezvous(url: str, timeout: timedelta = default_pg_timeout, **kwargs: Any):
    """Rendezvous handler: torchrun's agent store under a prefix naming the restart attempt.

    torchrun keeps one store across the attempts of ``--max-restarts``, and the keys a killed attempt left
    there (gloo's and RPC's listening addresses) would send the next attempt to dead ports (``Gloo
    connectFullMesh failed ... Connection refused``).
    """
    query = dict(parse_qsl(urlparse(url).query))
    rank, world = int(query["rank"]), int(query["world_size"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    attempt = agreed_attempt(store, rank, world, timeout=timeout)
    yield dist.PrefixStore(f"torchrlhf/attempt_{attempt}", store), rank, world


def agreed_attempt(store: dist.Store, rank: int, world: int, timeout: timedelta = default_pg_timeout,
                   poll_s: float = 0.02) -> str:
    """A name for this attempt that every rank of it agrees on, whatever earlier attempts left in ``store``.

    Rank 0 first deletes the handshake keys of earlier attempts (their ranks are gone), then answers each rank's
    fresh nonce with its own; a rank takes the name only from an answer to its own nonce, and rewrites the nonce
    until then (rank 0 may have deleted it). Rank 0 is done once every rank confirmed the nonce it answered.
    """
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0:
        while time.monotonic() < deadline:
            store.set(f"torchrlhf/nonce/{rank}", nonce)
            ack = _peek(store, f"torchrlhf/ack/{rank}")
            if ack is not None:
                seen, _, name = ack.partition(":")
                if seen == nonce:
                    store.set(f"torchrlhf/confirm/{rank}", nonce)
                    return name
            time.sleep(poll_s)
        raise TimeoutError(f"rank {rank}: rank 0 did not answer at the rendezvous within {timeout}")
    for other in range(1, world):
        for key in ("nonce", "ack", "confirm"):
            store.delete_key(f"torchrlhf/{key}/{other}")
    answered: dict[int, str] = {}
    pending = set(range(1, world))
    while pending:
        for other in sorted(pending):
            theirs = _peek(store, f"torchrlhf/nonce/{other}")
            if theirs is None:
                continue
            if answered.get(other) != theirs:
                store.set(f"torchrlhf/ack/{other}", f"{theirs}:{nonce}")
                answered[other] = theirs
            if _peek(store, f"torchrlhf/confirm/{other}") == theirs:
                pending.discard(other)
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"rank 0: ranks {sorted(pending)} did not reach the rendezvous within {timeout}")
        if pending:
            time.sleep(poll_s)
    return nonce


_ABSENT = "\0absent"  # no key's value: what `_peek` compares against, so its compare-and-set never sets


def _peek(store: dist.Store, key: str) -> str | None:
    """The value at ``key``, or None when there is none, without waiting. A check and then a get blocked once in
    the suite: rank 1 waited in the get of an ack the store no longer held (rank 0's clean-up is the one
    delete), rank 0 for a nonce rank 1 no longer rewrote, until the store's timeout. One atomic compare-and-set
    that sets nothing reads it."""
    value = store.compare_set(key, _ABSENT, _ABSENT).decode()
    return None if value == _ABSENT else value


dist.register_rendezvous_handler(_ATTEMPT_SCHEME, _attempt_store_rendezvous)


def _tune_malloc() -> None:
    """Make glibc's malloc keep and reuse freed memory, like a caching allocator (Linux/glibc only).

    - One arena: RPC runs each call on one of a pool of threads, and glibc gives threads their own
      arenas, so memory a step freed in one arena was not reused by the next step's thread (a rank's
      RSS grew by ~1 GB per step on SmolLM2: 3.5 -> 7.3 GB in 4 steps; 3.65 GB flat with one arena).
    - No mmap, no trimming: glibc serves large blocks (above a threshold of at most 32 MB:
      vocabulary-sized logits and gradients) from fresh mmap pages and unmaps them on free, so each
      micro-batch faulted them in again: 45 % of an actor's CPU time went to the kernel in
      ``bench_async.py``. Kept in the heap, they are reused; RSS stays at its peak between steps.

    Each setting is left alone when its ``MALLOC_*_`` environment variable is set.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
    settings = [("MALLOC_ARENA_MAX", M_ARENA_MAX, 1), ("MALLOC_MMAP_MAX_", M_MMAP_MAX, 0),
                ("MALLOC_TRIM_THRESHOLD_", M_TRIM_THRESHOLD, -1)]  # -1: never trim
    for env, option, value in settings:
        if env not in os.environ:
            libc.mallopt(option, value)


def init(*, rpc_timeout: float = DEFAULT_RPC_TIMEOUT, num_worker_threads: int = 16) -> int:
    """Initialise the default process group and RPC on this rank; returns the global rank.

    Reads torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    LOCAL_RANK); without it, starts a one-process world on loopback.
    """
    if _state["initialized"]:
        return dist.get_rank()
    _tune_malloc()  # before RPC starts its thread pool
    global _stop_code, _stop_alone
    _stop_event.clear()
    _stop_code, _stop_alone = 0, False
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    cuda = torch.cuda.is_available()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if torchrun:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _bind_to_master_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            init_method = f"{_ATTEMPT_SCHEME}://"  # torchrun's store, a fresh key space per restart attempt
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world)
            # No torchrun agent store: env:// makes rank 0 host a store at MASTER_PORT, which the
            # process group already took, so RPC rendezvous on the next port.
            init_method = f"tcp://{os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) + 1}"
    else:
        rank, world = 0, 1
        _bind_to_master_interface("127.0.0.1")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        fd, path = tempfile.mkstemp(prefix="torchrlhf-rpc-")  # a file store: no TCP listener at all
        os.close(fd)
        os.unlink(path)
        init_method = f"file://{path}"
        _state["store_file"] = path
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=num_worker_threads, rpc_timeout=rpc_timeout, init_method=init_method,
        # TCP (libuv) only: the shared-memory transport's reactor thread busy-polls a core in every
        # process (a third of a 2-core machine in a one-process run); control calls are ms to s long.
        _transports=["uv"],
    )
    with warnings.catch_warnings():  # torch's own init_rpc trips its gloo deprecation warning
        warnings.filterwarnings("ignore", message="You are using a Backend")
        rpc.init_rpc(worker_name(rank), rank=rank, world_size=world, rpc_backend_options=options)
    _state.update(initialized=True, notebook=not torchrun, rpc_timeout=rpc_timeout)
    return rank


def mark_lost(rank: int) -> None:
    """Controller side: ``rank`` died and the job goes on without it; shutdown no longer waits for it."""
    _lost.add(rank)


def lost_ranks() -> set[int]:
    return set(_lost)


def is_reachable(rank: int, timeout: float = 10.0) -> bool:
    """Controller side: whether ``rank``'s process still answers RPC (a dead one fails at once: EOF)."""
    try:
        rpc.rpc_sync(worker_name(rank), _ping, timeout=timeout)
        return True
    except Exception:
        return False


def _bounded(fn: Callable[[], None], timeout: float) -> bool:
    """Run ``fn`` in a daemon thread; True if it finished without error within ``timeout``."""
    ok: list[bool] = []

    def run() -> None:
        try:
            fn()
            ok.append(True)
        except Exception:  # reported by the caller's fallback
            traceback.print_exc()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return bool(ok)


def _stop(code: int, alone: bool = False) -> None:
    """RPC target: tell a worker rank's main thread to stop with ``code`` (``alone``: without the others)."""
    global _stop_code, _stop_alone
    if code != 0:  # printed before the controller hears back, so it is always in the log
        rank = dist.get_rank()
        msg = f"torchrlhf: rank {rank} stopping with exit code {code} (the controller's main failed)"
        print(msg, file=sys.stderr, flush=True)
    _stop_code, _stop_alone = code, alone
    _stop_event.set()


def _ping() -> None:
    """RPC target of the workers' heartbeat."""


def _broadcast_stop(code: int, timeout: float) -> None:
    alone = bool(_lost)
    futs = [
        rpc.rpc_async(worker_name(r), _stop, args=(code, alone), timeout=timeout)
        for r in range(1, dist.get_world_size()) if r not in _lost
    ]
    for f in futs:
        try:
            f.wait()
        except Exception:  # that rank is already gone; the others still stop
            pass


def _hard_exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shutdown(code: int = 0, *, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Controller side: stop every rank with ``code`` and tear down RPC and the process group.

    ``code == 0`` is a graceful, bounded shutdown; otherwise the other ranks
    exit with ``code`` immediately and this rank only shuts down locally.
    """
    if not _state["initialized"]:
        return
    _broadcast_stop(code, timeout=shutdown_timeout)
    _finish(code, shutdown_timeout)


def _forget_run() -> None:
    """Close this process's workers and forget the run's registries (`_on_finish`)."""
    for reset in _on_finish:
        reset()


def _finish(code: int, shutdown_timeout: float) -> None:
    graceful = code == 0 and not _lost and not _stop_alone
    done = _bounded(lambda: rpc.shutdown(graceful=graceful, timeout=shutdown_timeout), shutdown_timeout + 5)
    if not done:
        print(f"torchrlhf: RPC shutdown did not finish in {shutdown_timeout}s; exiting", file=sys.stderr)
        _hard_exit(code or 1)
    _forget_run()
    if dist.is_initialized():
        dist.destroy_process_group()
    if _state.get("store_file"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_state.pop("store_file"))
    _state["initialized"] = False
    _lost.clear()


def _serve(heartbeat_s: float, shutdown_timeout: float) -> int:
    """Worker ranks: serve RPC until the controller says stop (or disappears)."""
    failures = 0
    while not _stop_event.wait(heartbeat_s):
        try:
            rpc.rpc_sync(worker_name(0), _ping, timeout=max(heartbeat_s, 10.0))
            failures = 0
        except Exception as e:
            failures += 1
            if failures >= 2 and not _stop_event.is_set():
                print(f"torchrlhf: rank {dist.get_rank()} lost the controller (rank 0): {e}", file=sys.stderr)
                _hard_exit(1)
    if _stop_code != 0:
        _hard_exit(_stop_code)
    if _stop_alone:  # a rank was lost: close the roles (bounded), then leave without waiting for anyone
        _bounded(_forget_run, shutdown_timeout)
        _hard_exit(0)
    _finish(0, shutdown_timeout)
    return _stop_code


EVERY_RANK_WAIT_S = 30.0


def exit_every_rank(message: str, code: int = 2, *, wait_s: float = EVERY_RANK_WAIT_S) -> NoReturn:
    """Exit with an error that every rank finds before the runtime starts (a config error): printed once, by rank 0.

    Under torchrun the first rank to exit gets the others killed (SIGTERM), so a rank that exits before rank 0
    has printed loses the message (1 of 6 runs did). The other ranks therefore wait for rank 0 to end the job
    (at most ``wait_s``); one still alive then saw an error rank 0 did not, and prints it, naming its rank.
    """
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if rank != 0 and world > 1:
        time.sleep(wait_s)  # ended here by torchrun once rank 0 has printed and exited
        message = f"{message} (rank {rank})"
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def launch(
    main: Callable[..., Any],
    *args: Any,
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    heartbeat_s: float = DEFAULT_HEARTBEAT_S,
) -> Any:
    """Run ``main(*args)`` as the single controller of a torchrun job (call on every rank).

    Returns ``main``'s result on rank 0; worker ranks exit the process when the
    controller is done (status 0, or ``main``'s int result if nonzero, or 1 when
    ``main`` raised). When ``main`` raises under torchrun, rank 0 prints the
    traceback, stops every rank and exits with status 1 (``SystemExit`` keeps
    its code); in notebook mode the exception is re-raised. Use
    ``sys.exit(launch(main))`` to make an int result the exit status of rank 0.

    Args:
        rpc_timeout: default timeout (s) of every RPC, including worker method calls.
        shutdown_timeout: bound (s) on the graceful shutdown; past it ranks ``os._exit``.
        heartbeat_s: how often worker ranks check the controller is alive.
    """
    rank = init(rpc_timeout=rpc_timeout)
    compute_thread.reserve_intra_op_threads()  # the controller's ops are small; training and decoding are not
    if rank != 0:
        code = _serve(heartbeat_s, shutdown_timeout)
        sys.exit(code)
    try:
        result = main(*args)
    except BaseException as e:
        if isinstance(e, SystemExit) and isinstance(e.code, int):
            code = e.code
        else:
            code = 1
            if not _state["notebook"]:  # print first: torchrun may SIGTERM us once a worker rank exits
                print("torchrlhf: main raised on the controller (rank 0):", file=sys.stderr)
                traceback.print_exc()
                sys.stderr.flush()
        notebook = _state["notebook"]
        try:
            shutdown(code, shutdown_timeout=min(shutdown_timeout, 5.0))
        except Exception:
            traceback.print_exc()
            _hard_exit(code or 1)
        if notebook or isinstance(e, SystemExit):
            raise
        _hard_exit(code)
    code = result if isinstance(result, int) and not isinstance(result, bool) else 0
    shutdown(code, shutdown_timeout=shutdown_timeout)
    return result


__all__ = ["init", "launch", "exit_every_rank", "shutdown", "is_initialized", "interface_for", "worker_name", "mark_lost",
           "lost_ranks", "is_reachable"]
