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
    JAX_COORDINATOR_BIND_ADDRESS   the same host:port, where process 0's coordinator listens
    PK_JAX_LAUNCH_DIR         a directory of the launcher's, where `initialize()` records that
                              this rank joined the job
    PK_JAX_LAUNCHER_PID       the launcher's pid: the child dies with it (Linux)
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

The launcher prefixes every line a child prints with `[rank i] `. The job ends as soon as it is
decided:

- A child exits with a non-zero status: the launcher terminates the others (their whole process
  groups) and exits with that status, naming the rank. A rank that raises, or calls
  `sys.exit(code)` with a non-zero code, after `initialize()` exits at once: JAX's distributed
  shutdown, which Python would run at exit, waits for the healthy ranks (up to minutes), so it is
  skipped (`initialize()` hooks uncaught exceptions; the launcher runs the script through a small
  runner that catches `SystemExit`).
- A child exits with status 0 without having called `initialize()`: the job fails (status 2).
  Without it the N processes would each run the whole program alone, and all "succeed".
- The job runs longer than `--timeout` seconds (default 3600; 0: no limit): every child is
  terminated, the ranks still running are named, and the launcher exits with 124.
- The launcher gets SIGTERM or SIGINT: it terminates every child (SIGTERM, then SIGKILL after a
  5 s grace); a second signal during the grace kills them at once. On Linux the children also
  get SIGKILL when the launcher itself dies (a parent-death signal, which the runner sets), so
  no rank outlives a launcher killed with SIGKILL. (Processes a child starts itself are its own
  to end.)

The coordinator (`jax.distributed`'s service, in process 0) listens on the advertised host only
(127.0.0.1), not on every interface: its key-value store carries pk.init's rendezvous, which only
the job's own processes may reach.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

ENV_COORDINATOR = "PK_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "PK_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PK_JAX_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "PK_JAX_LOCAL_DEVICE_IDS"
ENV_PLATFORM = "PK_JAX_PLATFORM"
ENV_CPU_DEVICES = "PK_JAX_CPU_DEVICES"
ENV_LAUNCH_DIR = "PK_JAX_LAUNCH_DIR"
ENV_LAUNCHER_PID = "PK_JAX_LAUNCHER_PID"

TIMEOUT_EXIT = 124
NOT_INITIALIZED_EXIT = 2
# A job-wide bound, so that a hung rank (a peer that never arrives, a deadlock) ends the job
# instead of holding the machine forever; long runs pass a larger --timeout, or 0 for none.
DEFAULT_TIMEOUT_S = 3600.0
_GRACE_S = 5.0


# --------------------------------------------------------------------------------------------
# In the child: initialize()
# --------------------------------------------------------------------------------------------


def initialize(*, initialization_timeout: int = 300) -> bool:
    """Joins the `jax.distributed` job this process belongs to, if any.

    Call it once, at the top of the script, before any JAX computation or device query.

    - Under `python -m pk_jax.launch`: `jax.distributed.initialize` with the coordinator, the
      process count and id, and the local device ids the launcher chose; process 0's
      coordinator listens on the advertised host only. On CPU machines the process gets
      PK_JAX_CPU_DEVICES CPU devices (default 1).
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
        coordinator = env[ENV_COORDINATOR]
        # JAX's default binds the coordinator to every interface ([::]:port).
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num,
                                   process_id=pid, local_device_ids=ids,
                                   initialization_timeout=initialization_timeout,
                                   coordinator_bind_address=coordinator)
        _exit_at_once_on_error()
        _record_joined()
        return True
    if _cluster_detected():
        jax.distributed.initialize(initialization_timeout=initialization_timeout)
        return True
    return False


def _joined_marker(launch_dir: str, rank: int | str) -> str:
    return os.path.join(launch_dir, f"joined.{rank}")


def _record_joined() -> None:
    """Tells the launcher that this rank joined the job (a file in its PK_JAX_LAUNCH_DIR)."""
    launch_dir = os.environ.get(ENV_LAUNCH_DIR)
    if launch_dir:
        with open(_joined_marker(launch_dir, os.environ.get(ENV_PROCESS_ID, "?")), "w"):
            pass


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
            _exit_at_once(1, f"failed with {kind.__name__}")
        finally:
            os._exit(1)

    sys.excepthook = hook


def _exit_at_once(status: int, why: str) -> None:
    """Flushes the streams and leaves with `status`, skipping the exit handlers (JAX's
    distributed shutdown among them, which would wait for the other ranks)."""
    try:
        rank = os.environ.get(ENV_PROCESS_ID, "?")
        print(f"pk_jax.launch: rank {rank} {why}; exiting at once (the launcher ends the other "
              "ranks)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def _cluster_detected() -> bool:
    """Whether one of jax.distributed's auto-detected cluster environments is present."""
    try:
        from jax._src import clusters  # the registry jax.distributed.initialize() walks

        return any(not c.opt_in_only_method and c.is_env_present()
                   for c in clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):
        # A private API moved: fall back to the common schedulers' variables.
        return any(v in os.environ for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"))


# The child's `python -c` program: load this file as a module of its own and run the script
# through `_run_child`. Not `import pk_jax.launch`, which imports pk_jax and JAX (seconds) before
# the script even starts; this file imports JAX only in initialize().
_CHILD_BOOT = """\
import importlib.util
spec = importlib.util.spec_from_file_location("_pk_jax_launch_runner", {path!r})
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)
runner._run_child()
"""


def _run_child() -> None:
    """Runs the script (`-c` argv: `--script path args...` or `--module name args...`) as
    `python path args...` or `python -m name args...` would, and ends the process at once when
    the script exits with a non-zero status after joining a jax.distributed job. The process
    dies with the launcher.

    `sys.exit(3)` raises SystemExit, which Python turns into the exit status only after the
    exit handlers, JAX's distributed shutdown among them: that shutdown waits for the healthy
    ranks, so the failure would hold the job until they finish. Uncaught exceptions take the
    hook `initialize()` installs.
    """
    import functools
    import runpy

    _die_with_launcher()
    kind, target, *args = sys.argv[1:]
    sys.argv = [target, *args]
    if kind == "--module":
        if not sys.flags.safe_path:
            sys.path[0] = os.getcwd()  # `-c` put "" there; `-m` puts the directory
        run = functools.partial(runpy.run_module, target, run_name="__main__", alter_sys=True)
    else:
        if not sys.flags.safe_path:
            if os.path.isfile(target) and not _is_zip(target):
                sys.path[0] = os.path.dirname(os.path.realpath(target))
            else:
                del sys.path[0]  # run_path puts the directory or archive there itself
        # An absolute __file__ and traceback paths, as `python script.py` gives them.
        run = functools.partial(runpy.run_path, os.path.abspath(target), run_name="__main__")
    try:
        run()
    except SystemExit as e:
        status = _exit_status(e.code)
        if _joined():
            if status:
                if not isinstance(e.code, int):
                    print(e.code, file=sys.stderr)
                _exit_at_once(status, f"exited with status {status}")
            _record_joined()
        raise
    except Exception as e:  # noqa: BLE001 -- reported by the hook, as Python would
        tb = _script_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)
    if _joined():  # also a script that called jax.distributed.initialize itself
        _record_joined()


def _die_with_launcher() -> None:
    """Asks Linux to SIGKILL this child when the launcher dies (a parent-death signal).

    The children run in their own sessions (so that the launcher can end each one's process
    group), where nothing else would end them if the launcher were killed with SIGKILL. Set
    here, after exec, rather than in a preexec_fn, which runs between fork and exec and is unsafe
    in a process with threads (the launcher's pumps; JAX's, when a program calls launch()).
    """
    launcher = os.environ.get(ENV_LAUNCHER_PID)
    if not launcher or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(launcher):  # the launcher died before the call above
        os.kill(os.getpid(), signal.SIGKILL)


def _is_zip(path: str) -> bool:
    import zipfile

    return zipfile.is_zipfile(path)


def _exit_status(code) -> int:
    """The process status Python gives `SystemExit(code)`: None is 0, an int is itself (as
    the OS keeps it, modulo 256), anything else is printed and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def _joined() -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and jax.distributed.is_initialized()


def _script_frames(tb):
    """`tb` without the runner's leading frames (this module, runpy), as `python script.py`
    would print it."""
    import runpy

    runner = {"<string>", "<frozen runpy>", os.path.abspath(__file__), runpy.__file__}
    while tb.tb_next is not None and tb.tb_frame.f_code.co_filename in runner:
        tb = tb.tb_next
    return tb


def script_command(target: str, args: Sequence[str] = (), *, module: bool = False) -> list[str]:
    """The argv of a child that runs a Python script (or module) the way the launcher does.

    The child runs `target` as `python target args...` (or `python -m target args...`) would,
    through a small runner that makes a non-zero `sys.exit` end the process at once once it
    joined the job, and makes the child die with the launcher (see the module docstring).

    Args:
        target: the script's path, or the module's name with module=True.
        args: the script's arguments.
        module: run `target` as a module, like `python -m`.

    Returns:
        The child's argv, for `launch`.
    """
    return [sys.executable, "-c", _CHILD_BOOT.format(path=os.path.abspath(__file__)),
            "--module" if module else "--script", target, *args]


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
              mem_fraction: float | None, base: dict[str, str] | None = None,
              launch_dir: str | None = None) -> dict[str, str]:
    """The environment of child `rank` (see the module docstring)."""
    env = dict(os.environ if base is None else base)
    env.update({
        ENV_COORDINATOR: coordinator,
        ENV_NUM_PROCESSES: str(n),
        ENV_PROCESS_ID: str(rank),
        ENV_PLATFORM: platform,
        "JAX_COORDINATOR_ADDRESS": coordinator,
        # Also for a script that calls jax.distributed.initialize itself.
        "JAX_COORDINATOR_BIND_ADDRESS": coordinator,
        ENV_LAUNCHER_PID: str(os.getpid()),
        "PYTHONUNBUFFERED": "1",
    })
    # JAX's preemption service catches SIGTERM (it waits for a preemption sync point that a
    # local job never reaches), so a healthy rank would outlive the launcher's SIGTERM and hold
    # the job until the SIGKILL after the grace. Off unless the user sets it.
    env.setdefault("JAX_ENABLE_PREEMPTION_SERVICE", "false")
    env.pop(ENV_LOCAL_DEVICE_IDS, None)
    env.pop(ENV_LAUNCH_DIR, None)
    if launch_dir is not None:
        env[ENV_LAUNCH_DIR] = launch_dir
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


def _terminate(procs: Sequence[subprocess.Popen], hurry: threading.Event | None = None) -> None:
    """SIGTERM to every live child's process group, SIGKILL to what is left after a grace (at
    once when `hurry` is set, before or during the grace)."""
    def hurried() -> bool:
        return hurry is not None and hurry.is_set()

    for sig in (signal.SIGTERM, signal.SIGKILL):
        if sig == signal.SIGTERM and hurried():
            continue
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + _GRACE_S
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            if sig == signal.SIGTERM and hurried():
                break
            time.sleep(0.05)
    for p in procs:
        try:  # the group may outlive its leader
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def launch(command: Sequence[str], n: int, *, share_gpu: bool = False, port: int | None = None,
           timeout: float | None = DEFAULT_TIMEOUT_S, mem_fraction: float | None = None,
           host: str = "127.0.0.1", out=None) -> int:
    """Runs `command` as N processes of one jax.distributed job; returns the job's exit status.

    Args:
        command: the child's argv; `script_command(...)` builds one that runs a Python script
            as the command line does, with the runner that ends a rank at once on a non-zero
            `sys.exit` and ties the child's life to the launcher's (other commands go without).
        n: the number of processes.
        share_gpu: put every process on GPU 0 (each with 0.9/N of its memory).
        port: the coordinator's port; default: a free one.
        timeout: seconds before every child is terminated (exit status 124); None or 0: no
            limit. Default DEFAULT_TIMEOUT_S (one hour).
        mem_fraction: XLA_PYTHON_CLIENT_MEM_FRACTION for each child (GPU only).
        host: the coordinator's address; it listens there only.
        out: a binary stream for the prefixed output (default: sys.stdout's buffer).

    Returns:
        0 when every child succeeded; else the first failing child's status (128 + signal for a
        child killed by a signal), NOT_INITIALIZED_EXIT (2) when a child succeeded without
        calling `initialize()`, or TIMEOUT_EXIT (124) on timeout.

    Raises:
        ValueError: n < 1, a negative or NaN timeout, or more processes than GPUs without
            share_gpu.
    """
    if n < 1:
        raise ValueError(f"pk_jax.launch: -n must be at least 1, got {n}.")
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"pk_jax.launch: --timeout must be a number of seconds >= 0 (0: no "
                         f"limit), got {timeout}.")
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
    launch_dir = tempfile.mkdtemp(prefix="pk_jax-launch-")
    stopping, hurry = threading.Event(), threading.Event()

    def on_signal(signum, frame):
        if stopping.is_set():  # a second signal, while the children are being terminated
            hurry.set()
            return
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    old = ({s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
           if main_thread else {})
    try:
        for rank in range(n):
            env = child_env(rank, n, coordinator, platform=platform, share_gpu=share_gpu,
                            mem_fraction=mem_fraction, launch_dir=launch_dir)
            p = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 start_new_session=True)
            procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
            t.start()
            pumps.append(t)
        deadline = time.monotonic() + timeout if timeout else None
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
            alone = [r for r, c in enumerate(codes)
                     if c == 0 and not os.path.exists(_joined_marker(launch_dir, r))]
            if alone:
                status = NOT_INITIALIZED_EXIT
                _report(out, lock, f"{_ranks(alone)} finished without calling "
                        "pk_jax.launch.initialize(), so the processes did not form one job (each "
                        "ran the whole program alone). Call pk_jax.launch.initialize() at the top "
                        "of the script, before using JAX; failing the job")
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                status = TIMEOUT_EXIT
                running = [r for r, c in enumerate(codes) if c is None]
                _report(out, lock, f"timeout after {timeout:g} s (--timeout) with "
                        f"{_ranks(running)} still running; terminating every process")
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        status = 130
        _report(out, lock, "interrupted; terminating every process (a second signal kills "
                "them at once)")
    finally:
        stopping.set()
        _terminate(procs, hurry)
        for t in pumps:
            t.join(timeout=_GRACE_S)
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(launch_dir, ignore_errors=True)
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
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds before every process is terminated (exit status 124); "
                             f"default {DEFAULT_TIMEOUT_S:g}, 0: no limit")
    parser.add_argument("--mem-fraction", type=float, default=None,
                        help="XLA_PYTHON_CLIENT_MEM_FRACTION per process (GPU)")
    parser.add_argument("-m", dest="module", default=None, help="run a module, like python -m")
    parser.add_argument("script", nargs="?", help="the Python script each process runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    opts = parser.parse_args(argv)
    if opts.module is not None:
        args = ([opts.script] if opts.script else []) + opts.args
        command = script_command(opts.module, args, module=True)
    elif opts.script:
        command = script_command(opts.script, opts.args)
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
