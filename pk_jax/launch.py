"""Start N JAX processes on this host, one `jax.distributed` job, and stream their output.

Usage::

    python -m pk_jax.launch -n 4 [--share-gpu] [--port P] [--timeout S] script.py [args ...]
    python -m pk_jax.launch -n 4 -m package.module [args ...]

Each child runs `script.py` with the same arguments and these environment variables:

    PK_JAX_COORDINATOR        host:port of the coordinator (process 0 serves it)
    PK_JAX_NUM_PROCESSES      N
    PK_JAX_PROCESS_ID         0 .. N-1 (also the rank printed before its output lines)
    PK_JAX_LOCAL_DEVICE_IDS   the GPUs this process drives: "i" (one GPU each) or "0"
                              (--share-gpu: every process on GPU 0); unset on CPU machines
    PK_JAX_PLATFORM           "gpu" or "cpu"
    JAX_COORDINATOR_ADDRESS   the coordinator again, which `jax.distributed.initialize` reads
    XLA_PYTHON_CLIENT_MEM_FRACTION   with --share-gpu: 0.9 / N (or --mem-fraction), so that the
                              processes fit on one GPU beside pk_jax's symmetric workspaces

The script calls `pk_jax.launch.initialize()` first thing, before anything touches a device:

    import pk_jax.launch
    pk_jax.launch.initialize()      # jax.distributed.initialize from the variables above
    import jax
    print(jax.process_index(), jax.process_count(), jax.devices())

Without the launcher's variables, `initialize()` hands over to `jax.distributed.initialize()`'s
own cluster detection (SLURM, Open MPI, ...) when one is present, and does nothing in a plain
single process, so the same script runs under the launcher, on a cluster and alone.

On CPU machines each process gets one CPU device (override with PK_JAX_CPU_DEVICES) and
cross-process collectives go through JAX's gloo CPU collectives, so `shard_map` programs over
all processes' devices run (slowly) on a laptop.

The launcher prefixes every line a child prints with `[rank i] `. When a child exits with a
non-zero status, the launcher terminates the others (their whole process groups) and exits with
that status, naming the rank; past `--timeout` seconds it terminates all of them and exits with
124. A child whose script raises exits at once (after printing the traceback): `initialize()`
installs an exception hook that skips JAX's distributed shutdown, which would otherwise wait for
the healthy ranks (up to minutes), so the whole job ends within seconds of one rank failing.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

ENV_COORDINATOR = "PK_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "PK_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PK_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "PK_JAX_LOCAL_DEVICE_IDS"
ENV_PLATFORM = "PK_JAX_PLATFORM"
ENV_CPU_DEVICES = "PK_JAX_CPU_DEVICES"

TIMEOUT_EXIT = 124
_GRACE_S = 5.0


# --------------------------------------------------------------------------------------------
# In the child: initialize()
# --------------------------------------------------------------------------------------------


def initialize(*, initialization_timeout: int = 300) -> bool:
    """Joins the `jax.distributed` job this process belongs to, if any.

    Call it once, at the top of the script, before any JAX computation or device query.

    - Under `python -m pk_jax.launch`: `jax.distributed.initialize` with the coordinator, the
      process count and id, and the local device ids the launcher chose. On CPU machines the
      process gets PK_JAX_CPU_DEVICES CPU devices (default 1).
    - Otherwise, when `jax.distributed`'s cluster detection recognises the environment (SLURM,
      Open MPI, Kubernetes, TPU pods): `jax.distributed.initialize()` without arguments.
    - Otherwise (one plain process): nothing.

    Calling it again after a successful initialisation does nothing.

    Args:
        initialization_timeout: seconds to wait for every process to join.

    Returns:
        Whether this process is part of a multi-process `jax.distributed` job now.

    Raises:
        ValueError: the launcher's variables are malformed.
    """
    import jax

    if jax.distributed.is_initialized():
        return True
    env = os.environ
    if ENV_COORDINATOR in env:
        try:
            num = int(env[ENV_NUM_PROCESSES])
            pid = int(env[ENV_PROCESS_ID])
            ids_text = env.get(ENV_LOCAL_DEVICE_IDS, "").strip()
            ids = [int(i) for i in ids_text.split(",")] if ids_text else None
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"pk_jax.launch.initialize: {ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES}, "
                f"{ENV_PROCESS_ID} or {ENV_LOCAL_DEVICE_IDS} is missing or not an integer "
                f"({e!r}). Start the script with `python -m pk_jax.launch -n N script.py`."
            ) from e
        if env.get(ENV_PLATFORM) == "cpu":
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", int(env.get(ENV_CPU_DEVICES, "1")))
        jax.distributed.initialize(coordinator_address=env[ENV_COORDINATOR], num_processes=num,
                                   process_id=pid, local_device_ids=ids,
                                   initialization_timeout=initialization_timeout)
        _exit_at_once_on_error()
        return True
    if _cluster_detected():
        jax.distributed.initialize(initialization_timeout=initialization_timeout)
        return True
    return False


def _exit_at_once_on_error() -> None:
    """Makes an uncaught exception end this process at once, with status 1.

    Python would print the traceback and then run the exit handlers, among them JAX's
    distributed shutdown, which waits for every other process of the job: a failing rank would
    hold the job until the healthy ones finish. Here the traceback is printed, the streams
    flushed, and the process leaves with os._exit; the launcher then ends the other ranks.
    """
    previous = sys.excepthook

    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
            rank = os.environ.get(ENV_PROCESS_ID, "?")
            print(f"pk_jax.launch: rank {rank} failed with {kind.__name__}; exiting at once "
                  "(the launcher ends the other ranks)", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(1)

    sys.excepthook = hook


def _cluster_detected() -> bool:
    """Whether one of jax.distributed's auto-detected cluster environments is present."""
    try:
        from jax._src import clusters  # the registry jax.distributed.initialize() walks

        return any(not c.opt_in_only_method and c.is_env_present()
                   for c in clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):
        # A private API moved: fall back to the common schedulers' variables.
        return any(v in os.environ for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"))


# --------------------------------------------------------------------------------------------
# In the launcher
# --------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def visible_gpus() -> int:
    """How many NVIDIA GPUs a child would see, without initialising CUDA or importing JAX
    (JAX_PLATFORMS=cpu in the environment makes the launcher treat the machine as CPU-only)."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len([f for f in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", f)])
    except OSError:
        return 0


def child_env(rank: int, n: int, coordinator: str, *, platform: str, share_gpu: bool,
              mem_fraction: float | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of child `rank` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update({
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(n),
        ENV_PROCESS_ID: str(rank),
        ENV_PLATFORM: platform,
        "JAX_COORDINATOR_ADDRESS": coordinator,
        "PYTHONUNBUFFERED": "1",
    })
    # JAX's preemption service catches SIGTERM (it waits for a preemption sync point that a
    # local job never reaches), so a healthy rank would outlive the launcher's SIGTERM and hold
    # the job until the SIGKILL after the grace. Off unless the user sets it.
    env.setdefault("JAX_ENABLE_PREEMPTION_SERVICE", "false")
    env.pop(ENV_LOCAL_DEVICE_IDS, None)
    if platform == "gpu":
        env[ENV_LOCAL_DEVICE_IDS] = "0" if share_gpu else str(rank)
        if share_gpu:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction or 0.9 / n:.4f}"
        elif mem_fraction:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{mem_fraction:.4f}"
    return env


def _pump(rank: int, stream, out, lock: threading.Lock) -> None:
    prefix = f"[rank {rank}] ".encode()
    writable = True
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        if writable:
            with lock:
                try:
                    out.write(prefix + line)
                    out.flush()
                except (BrokenPipeError, ValueError):  # reader gone (e.g. `| head`)
                    writable = False  # keep draining, so the child never blocks on its pipe
    stream.close()


def _terminate(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to every live child's process group, SIGKILL to what is left after a grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _GRACE_S
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
    for p in procs:
        try:  # the group may outlive its leader
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def launch(command: Sequence[str], n: int, *, share_gpu: bool = False, port: int | None = None,
           timeout: float | None = None, mem_fraction: float | None = None,
           host: str = "127.0.0.1", out=None) -> int:
    """Runs `command` as N processes of one jax.distributed job; returns the job's exit status.

    Args:
        command: the child's argv, e.g. [sys.executable, "script.py", "--flag"].
        n: the number of processes.
        share_gpu: put every process on GPU 0 (each with 0.9/N of its memory).
        port: the coordinator's port; default: a free one.
        timeout: seconds before every child is terminated (exit status 124); None: no limit.
        mem_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION for each child (GPU only).
        host: the coordinator's address.
        out: a binary stream for the prefixed output (default: sys.stdout's buffer).

    Returns:
        0 when every child succeeded; else the first failing child's status (128 + signal for a
        child killed by a signal), or 124 on timeout.

    Raises:
        ValueError: n < 1, or more processes than GPUs without share_gpu.
    """
    if n < 1:
        raise ValueError(f"pk_jax.launch: -n must be at least 1, got {n}.")
    gpus = 0 if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu" else visible_gpus()
    platform = "gpu" if gpus else "cpu"
    if platform == "gpu" and not share_gpu and n > gpus:
        raise ValueError(f"pk_jax.launch: -n {n} processes but only {gpus} GPU(s) are visible. "
                         "Pass --share-gpu to run them all on GPU 0, or lower -n.")
    out = out if out is not None else sys.stdout.buffer
    coordinator = f"{host}:{port or free_port(host)}"
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    status = 0

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM,)}
    try:
        for rank in range(n):
            env = child_env(rank, n, coordinator, platform=platform, share_gpu=share_gpu,
                            mem_fraction=mem_fraction)
            p = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
            t.start()
            pumps.append(t)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                status = 128 - code if code < 0 else code
                pumps[rank].join(timeout=_GRACE_S)  # its last lines (a traceback) come first
                _report(out, lock, f"rank {rank} exited with status {code}; terminating the "
                        f"other processes (rank {rank} failed)")
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                status = TIMEOUT_EXIT
                _report(out, lock, f"timeout after {timeout:g} s; terminating every process")
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
        _report(out, lock, "interrupted; terminating every process")
    finally:
        _terminate(procs)
        for t in pumps:
            t.join(timeout=_GRACE_S)
        for s, h in old.items():
            signal.signal(s, h)
    return status


def _report(out, lock: threading.Lock, message: str) -> None:
    with lock:
        try:
            out.write(f"[pk_jax.launch] {message}\n".encode())
            out.flush()
        except (BrokenPipeError, ValueError):
            pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pk_jax.launch",
        description="Start N processes of one jax.distributed job on this host. The script "
                    "calls pk_jax.launch.initialize() before using JAX.")
    parser.add_argument("-n", "--nproc", type=int, required=True, help="number of processes")
    parser.add_argument("--share-gpu", action="store_true",
                        help="run every process on GPU 0, each with 0.9/N of its memory")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds before every process is terminated (exit status 124)")
    parser.add_argument("--mem-fraction", type=float, default=None,
                        help="XLA_PYTHON_CLIENT_MEM_FRACTION per process (GPU)")
    parser.add_argument("-m", dest="module", default=None, help="run a module, like python -m")
    parser.add_argument("script", nargs="?", help="the Python script each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    opts = parser.parse_args(argv)
    if opts.module is not None:
        args = ([opts.script] if opts.script else []) + opts.args
        command = [sys.executable, "-m", opts.module, *args]
    elif opts.script:
        command = [sys.executable, opts.script, *opts.args]
    else:
        parser.error("give a script (or -m module) to run")
    try:
        return launch(command, opts.nproc, share_gpu=opts.share_gpu, port=opts.port,
                      timeout=opts.timeout, mem_fraction=opts.mem_fraction)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
