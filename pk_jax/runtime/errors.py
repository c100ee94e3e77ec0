"""The error record that kernels fill when a spin-wait times out, and how it surfaces.

One record per process: int32[8] in pinned host memory mapped into every device
(`cuMemHostAlloc` with DEVICEMAP|PORTABLE), so a kernel writes it with plain stores and the host
reads it without a copy. Fields (ffi/comm.h, namespace comm_error):

    0 code   0 ok, 1 timeout, 2 rank mismatch (the first error wins)
    1 op     an op id (OP_NAMES: the op table, ffi/op_table.h)
    2 rank   the rank that stopped waiting
    3 peer   the peer it waited for (that never arrived)
    4..7     op-specific detail (e.g. the signal slot and the value waited for)

The user calls nothing to see an error: while a record is attached, a watcher thread polls it
(every `POLL_S`) and prints the error to stderr as soon as a kernel records it, and the next pk
op traced in Python (or `pk.init`) raises it as a RuntimeError, once. `pk_jax.check_errors()`
raises it on demand.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from pk_jax._op_table import OP_NAMES

CODES = {0: "ok", 1: "timeout", 2: "rank mismatch", 3: "mbarrier timeout"}
POLL_S = 0.05
RECORD_WORDS = 8
RECORD_BYTES = 4 * RECORD_WORDS

# Host address of the record, set by the runtime while communicators exist (0 otherwise).
_host_ptr: int = 0
_timeout_s: float = 0.0


_watch_lock = threading.Lock()
_watcher: _Watcher | None = None
_pending: str | None = None  # an error the watcher reported and no pk call has raised yet


class _Watcher(threading.Thread):
    """Polls the record; prints a new error to stderr at once and leaves it pending."""

    def __init__(self, poll_s: float):
        super().__init__(name="pk_jax-error-watcher", daemon=True)
        self.poll_s = poll_s
        self.stop = threading.Event()
        self.reported: tuple[int, ...] = (0,) * RECORD_WORDS

    def run(self) -> None:
        global _pending
        while not self.stop.wait(self.poll_s):
            record = read()
            if record[0] == 0:
                self.reported = record
                continue
            if record == self.reported:
                continue
            self.reported = record
            message = describe(record)
            with _watch_lock:
                _pending = message
            try:
                print(f"{message} (it is raised by the next pk call, or by "
                      "pk_jax.check_errors())", file=sys.stderr, flush=True)
            except (OSError, ValueError):  # stderr closed: the pending error still raises
                pass


def _attach(host_ptr: int, timeout_s: float = 0.0, *, poll_s: float | None = None) -> None:
    """Points check() and the watcher at a record (the runtime calls this; 0 detaches)."""
    global _host_ptr, _timeout_s, _watcher, _pending
    old, _watcher = _watcher, None
    if old is not None:
        old.stop.set()
        if old is not threading.current_thread():
            old.join()
    _host_ptr, _timeout_s = int(host_ptr), float(timeout_s)
    with _watch_lock:
        _pending = None
    if _host_ptr:
        _watcher = _Watcher(POLL_S if poll_s is None else poll_s)
        _watcher.start()


def check_pending() -> None:
    """Raises, once, an error a kernel recorded since the last report (pk ops call this).

    Raises:
        RuntimeError: naming the op, the rank and the peer that never arrived; the record is
            cleared, so that the next call may run.
    """
    global _pending
    if not _host_ptr:
        return
    record = read()
    with _watch_lock:
        message, _pending = _pending, None
    if record[0] != 0:
        message = describe(record)
        clear()
        if _watcher is not None:
            _watcher.reported = (0,) * RECORD_WORDS
    if message:
        raise RuntimeError(message)


def _words() -> ctypes.Array | None:
    if not _host_ptr:
        return None
    return (ctypes.c_int32 * RECORD_WORDS).from_address(_host_ptr)


def read() -> tuple[int, ...]:
    """The record's eight words (all zero when no communicator exists)."""
    words = _words()
    return tuple(words) if words is not None else (0,) * RECORD_WORDS


def describe(record: tuple[int, ...] | list[int]) -> str:
    """A sentence naming the op, the rank and the peer of a non-zero record."""
    code, op, rank, peer = (int(v) for v in record[:4])
    op_name = OP_NAMES.get(op, f"op {op}")
    detail = ", ".join(str(int(v)) for v in record[4:])
    if code == 1:
        waited = f" within {_timeout_s:g} s" if _timeout_s else ""
        return (f"pk_jax: {op_name} timed out on rank {rank}: peer {peer} never arrived{waited} "
                f"(detail {detail}). The peer's process may have died or never called the op; "
                "raise pk.init(timeout_s=...) or PK_JAX_TIMEOUT_S if it is only slow.")
    if code == 2:
        return (f"pk_jax: {op_name} on rank {rank}: the rank operand does not match the "
                f"communicator's rank (peer field {peer}, detail {detail}). The mesh passed to "
                "the shard_map is not the one given to pk.init, or its device order differs.")
    return (f"pk_jax: {op_name} failed on rank {rank} with error code {code} "
            f"(peer {peer}, detail {detail}).")


def check(*, reset: bool = False) -> None:
    """Raises RuntimeError if a kernel has recorded an error since the last reset.

    Args:
        reset: clear the record after reading it (the error is still raised).

    Raises:
        RuntimeError: naming the op, the rank and the peer that never arrived.
    """
    record = read()
    if record[0] == 0:
        return
    if reset:
        clear()
    raise RuntimeError(describe(record))


def check_errors(*, reset: bool = True) -> None:
    """Raises RuntimeError if a pk kernel has recorded an error (a peer that never arrived).

    pk ops and pk.init raise such an error by themselves, once, and a watcher prints it to
    stderr when it happens; call this to look at a point of your choosing, e.g. after a jitted
    step that failed with XLA's generic launch error.

    Args:
        reset: clear the record after reading it, so that later calls may run (default).

    Raises:
        RuntimeError: naming the op, the rank and the peer that never arrived.
    """
    global _pending
    with _watch_lock:
        message, _pending = _pending, None
    record = read()
    if record[0] == 0:
        if message:
            raise RuntimeError(message)
        return
    if reset:
        clear()
    raise RuntimeError(describe(record))


def clear() -> None:
    """Zeroes the record (after a reported error, before trying again)."""
    words = _words()
    if words is not None:
        for i in range(RECORD_WORDS):
            words[i] = 0
