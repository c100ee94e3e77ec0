"""Passing file descriptors between processes of one host: a Unix socket with SCM_RIGHTS.

An `FdServer` serves named file descriptors (with a small JSON description each) to processes
of the same user: its socket has a random name in a fresh private directory (mode 0700), and it
checks every client's uid with SO_PEERCRED. `fetch` connects, checks the server's uid the same
way, and receives duplicates of the descriptors it asks for, which it then owns.

Protocol, one connection per client: the client sends one request line `GET <key>\\n` per
descriptor and reads the reply before the next; a reply is a 4-byte big-endian length and a JSON
object ({"ok": true, "meta": ...} with one descriptor attached, or {"ok": false, "error": ...}).
`BYE\\n` ends the connection. Each connection is served by its own thread and has a deadline
(`timeout_s` for the whole conversation), so a client that connects and stalls, or dies, costs
its own connection only and never delays the others. This module uses only the standard
library (no JAX, no CUDA).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_LEN = struct.Struct(">I")
_MAX_LINE = 4096


class ExchangeError(RuntimeError):
    """The descriptor exchange failed; the message says with whom and why."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def _send_reply(conn: socket.socket, obj: dict, fd: int | None = None) -> None:
    payload = json.dumps(obj).encode()
    data = _LEN.pack(len(payload)) + payload
    if fd is None:
        conn.sendall(data)
    else:
        sent = socket.send_fds(conn, [data], [fd])
        if sent < len(data):
            conn.sendall(data[sent:])


def _recv_exact(conn: socket.socket, n: int, into: bytearray) -> None:
    while len(into) < n:
        chunk = conn.recv(n - len(into))
        if not chunk:
            raise ExchangeError("pk_jax: the descriptor server closed the connection mid-reply.")
        into += chunk


def _recv_reply(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, flags, _ = socket.recv_fds(conn, 65536, 4)
    buf = bytearray(data)
    try:
        if not buf:
            raise ExchangeError("pk_jax: the descriptor server closed the connection.")
        if flags & socket.MSG_CTRUNC:
            raise ExchangeError("pk_jax: a descriptor was lost in transit (MSG_CTRUNC); the "
                                "process may be out of file descriptors (ulimit -n).")
        _recv_exact(conn, _LEN.size, buf)
        (length,) = _LEN.unpack(bytes(buf[:_LEN.size]))
        _recv_exact(conn, _LEN.size + length, buf)
        return json.loads(bytes(buf[_LEN.size:_LEN.size + length])), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _read_line(conn: socket.socket, pending: bytearray, deadline: float | None = None
               ) -> str | None:
    while b"\n" not in pending:
        if len(pending) > _MAX_LINE:
            raise ExchangeError("request line too long")
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ExchangeError("the client missed its deadline")
            conn.settimeout(left)
        chunk = conn.recv(_MAX_LINE)
        if not chunk:
            return None
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line.decode()


def _drain(conn: socket.socket, timeout_s: float = 1.0) -> None:
    """Reads until the client hangs up (briefly), so it reads our last reply before it sees the
    connection close, instead of failing on a write with EPIPE."""
    conn.settimeout(timeout_s)
    try:
        while conn.recv(_MAX_LINE):
            pass
    except OSError:
        pass


class FdServer:
    """Serves descriptors by key over a private Unix socket until `close()`.

    Args:
        items: key -> (fd, meta): the descriptor to send (the server sends duplicates and never
            closes it) and a JSON-serialisable description sent along.
        allowed_uid: the only uid a client may have (default: this process's uid).
        timeout_s: how long one client's connection may last (its deadline).
        prefix: the private directory's name prefix (in $TMPDIR).
    """

    def __init__(self, items: dict[str, tuple[int, object]], *, allowed_uid: int | None = None,
                 timeout_s: float = 60.0, prefix: str = "pk_jax-"):
        self._items = dict(items)
        self._allowed_uid = os.getuid() if allowed_uid is None else int(allowed_uid)
        self._timeout_s = float(timeout_s)
        self.refused: list[int] = []  # uids of clients turned away
        self.served = 0
        self.expired = 0  # connections ended by their deadline
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._conns_lock = threading.Lock()
        self.directory = tempfile.mkdtemp(prefix=prefix)  # created 0700, name random
        os.chmod(self.directory, 0o700)
        self.path = os.path.join(self.directory, secrets.token_hex(8) + ".sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(self.path)
            self._sock.listen(64)
            self._sock.settimeout(0.1)  # how often the accept loop looks at the stop flag
        except BaseException:
            self._sock.close()
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pk_jax-fd-server",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._connection, args=(conn,), daemon=True,
                                 name="pk_jax-fd-conn")
            with self._conns_lock:
                self._conns[conn] = t
            t.start()

    def _connection(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._handle(conn)
        except TimeoutError:
            self.expired += 1
        except ExchangeError as e:
            if "deadline" in str(e):
                self.expired += 1
        except (OSError, UnicodeDecodeError):
            pass  # a broken client costs its own connection only
        finally:
            with self._conns_lock:
                self._conns.pop(conn, None)

    def _handle(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self._timeout_s
        conn.settimeout(self._timeout_s)
        _, uid, _ = peer_credentials(conn)
        if uid != self._allowed_uid:
            self.refused.append(uid)
            _send_reply(conn, {"ok": False, "error": f"uid {uid} is not allowed (the server "
                               f"runs as uid {self._allowed_uid})"})
            _drain(conn)
            return
        pending = bytearray()
        while True:
            line = _read_line(conn, pending, deadline)
            if line is None or line == "BYE":
                return
            verb, _, key = line.partition(" ")
            if verb != "GET":
                _send_reply(conn, {"ok": False, "error": f"bad request {line[:80]!r}"})
                _drain(conn)
                return
            if key not in self._items:
                _send_reply(conn, {"ok": False, "error": f"no descriptor named {key!r} here"})
                continue
            fd, meta = self._items[key]
            _send_reply(conn, {"ok": True, "meta": meta}, fd)
            self.served += 1

    def close(self) -> None:
        """Stops serving and removes the socket and its directory. Safe to call twice."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._conns_lock:
            live = dict(self._conns)
        for conn in live:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in live.values():
            t.join(timeout=5.0)
        self._sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> FdServer:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def fetch(path: str, keys: list[str], *, expected_uid: int | None = None,
          timeout_s: float = 60.0) -> list[tuple[int, object]]:
    """Receives the descriptors named `keys` from the FdServer at `path`.

    Returns:
        [(fd, meta)] in the order of `keys`; the caller owns (and closes) every fd.

    Raises:
        ExchangeError: the server is unreachable, runs as another uid, or lacks a key.
    """
    expected_uid = os.getuid() if expected_uid is None else int(expected_uid)
    out: list[tuple[int, object]] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            try:
                sock.connect(path)
            except OSError as e:
                raise ExchangeError(f"pk_jax: cannot reach the descriptor server at {path}: "
                                    f"{e}. Its process may have exited.") from e
            pid, uid, _ = peer_credentials(sock)
            if uid != expected_uid:
                raise ExchangeError(f"pk_jax: the descriptor server at {path} (pid {pid}) runs "
                                    f"as uid {uid}, not {expected_uid}; refusing its memory.")
            for key in keys:
                if "\n" in key or " " in key:
                    raise ValueError(f"pk_jax: descriptor key {key!r} has a space or newline.")
                try:
                    sock.sendall(f"GET {key}\n".encode())
                    reply, fds = _recv_reply(sock)
                except OSError as e:
                    raise ExchangeError(f"pk_jax: the descriptor server at {path} (pid {pid}) "
                                        f"dropped the connection while sending {key!r}: "
                                        f"{e}.") from e
                if not reply.get("ok"):
                    for fd in fds:
                        os.close(fd)
                    raise ExchangeError(f"pk_jax: the descriptor server at {path} (pid {pid}) "
                                        f"refused {key!r}: {reply.get('error')}.")
                if len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise ExchangeError(f"pk_jax: expected one descriptor for {key!r} from "
                                        f"{path}, got {len(fds)}.")
                out.append((fds[0], reply.get("meta")))
            try:
                sock.sendall(b"BYE\n")
            except OSError:
                pass
    except BaseException:
        for fd, _ in out:
            os.close(fd)
        raise
    return out
