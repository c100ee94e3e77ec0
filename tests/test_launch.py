"""The launcher: N CPU processes of one jax.distributed job, rank-prefixed output, failures and
timeouts that end the whole job without leaving processes behind (also when the launcher is
killed, or signalled twice), a coordinator on the advertised host only, and a script that never
joins the job failing it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pk_jax import launch

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import sys
import pk_jax.launch
assert pk_jax.launch.initialize()
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
print("count", jax.process_index(), jax.process_count(), jax.device_count(),
      jax.local_device_count())
mesh = jax.make_mesh((jax.device_count(),), ("x",))
total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"),
                              out_specs=P()))
a = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")),
                                           jnp.full((1,), jax.process_index() + 1.0))
print("psum", float(total(a)[0]))
print("args", sys.argv[1:])
"""


def _run(tmp_path: Path, body: str, *launcher_args: str, script_args=(), timeout=120):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pk_jax.launch", *launcher_args, str(script),
                           *script_args], check=False, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - start


def _lines(output: str, rank: int) -> list[str]:
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in output.splitlines() if line.startswith(prefix)]


def _pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed but not yet reaped by its new parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_until(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _start_launcher(tmp_path: Path, body: str, *launcher_args: str) -> subprocess.Popen:
    """The launcher as a background process (output discarded), for tests that signal it."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "pk_jax.launch", *launcher_args, str(script)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# Each child writes its pid to pid.<rank> and sleeps; with IGNORE_TERM it ignores SIGTERM.
_SLEEPER = """
import os, signal, time
if {ignore_term}:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
path = os.path.join({dir!r}, "pid." + os.environ["PK_JAX_PROCESS_ID"])
open(path + ".tmp", "w").write(str(os.getpid()))
os.rename(path + ".tmp", path)
time.sleep(120)
"""


def _child_pids(tmp_path: Path, n: int, seconds: float = 30) -> list[int]:
    files = [tmp_path / f"pid.{r}" for r in range(n)]
    assert _wait_until(lambda: all(f.exists() for f in files), seconds), "children never started"
    return [int(f.read_text()) for f in files]


def _kill_leftovers(pids) -> None:
    for pid in pids:
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_two_cpu_processes_form_one_job(tmp_path):
    # The pytest process has 8 forced host devices in XLA_FLAGS; each child still gets one.
    proc, _ = _run(tmp_path, WORKER, "-n", "2", "--timeout", "100",
                   script_args=("--flag", "-n", "3"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        lines = _lines(proc.stdout, rank)
        assert f"count {rank} 2 2 1" in lines, proc.stdout
        assert "psum 3.0" in lines, proc.stdout  # a gloo all-reduce across the two processes
        assert "args ['--flag', '-n', '3']" in lines, proc.stdout


def test_output_is_prefixed_line_by_line(tmp_path):
    body = """
    import os, sys
    import pk_jax.launch
    pk_jax.launch.initialize()
    rank = os.environ["PK_JAX_PROCESS_ID"]
    for i in range(3):
        print(f"line {i} of {rank}")
    print(f"err of {rank}", file=sys.stderr)
    sys.stdout.write("no newline")
    """
    proc, _ = _run(tmp_path, body, "-n", "3")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(3):
        # PYTHONUNBUFFERED=1 in the child keeps stdout and stderr in program order.
        assert _lines(proc.stdout, rank) == [f"line {i} of {rank}" for i in range(3)] + [
            f"err of {rank}", "no newline"]
    assert all(line.startswith(("[rank ", "[pk_jax.launch] "))
               for line in proc.stdout.splitlines())


def test_a_failing_child_fails_the_job_and_ends_the_others(tmp_path):
    pid_file = tmp_path / "pid"
    body = f"""
    import os, sys, time
    if os.environ["PK_JAX_PROCESS_ID"] == "1":
        time.sleep(0.5)
        sys.exit(3)
    open({str(pid_file)!r}, "w").write(str(os.getpid()))
    time.sleep(300)
    """
    proc, seconds = _run(tmp_path, body, "-n", "2")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert seconds < 30
    assert "rank 1 exited with status 3" in proc.stdout
    assert not _pid_alive(int(pid_file.read_text()))


@pytest.mark.parametrize(("failure", "status"), [
    ('raise RuntimeError("rank one fails")', 1),
    ("sys.exit(3)", 3),
])
def test_a_failing_rank_ends_the_job_within_seconds(tmp_path, failure, status):
    # Python runs its exit handlers after an uncaught exception or a SystemExit, JAX's
    # distributed shutdown among them, which waits for the healthy rank (here two minutes):
    # the exception hook of initialize() and the launcher's runner end the process at once.
    body = f"""
    import sys, time
    import pk_jax.launch
    pk_jax.launch.initialize()
    import jax
    jax.devices()
    if jax.process_index() == 1:
        print("failing at", time.time(), flush=True)
        {failure}
    time.sleep(120)
    """
    proc, _ = _run(tmp_path, body, "-n", "2", "--timeout", "60", timeout=90)
    end = time.time()
    assert proc.returncode == status, proc.stdout + proc.stderr
    [failed_at] = [float(line.split()[-1]) for line in _lines(proc.stdout, 1)
                   if line.startswith("failing at")]
    # Within the launcher's SIGTERM grace (5 s): the healthy rank ends on SIGTERM (JAX's
    # preemption service, which would catch it, is off in the children).
    assert end - failed_at < 4, proc.stdout
    assert "SIGTERM caught" not in proc.stdout, proc.stdout
    assert f"[pk_jax.launch] rank 1 exited with status {status}" in proc.stdout
    if status == 1:
        assert "RuntimeError: rank one fails" in _lines(proc.stdout, 1)
        # The traceback is the script's, without the launcher's runner frames.
        assert not any("runpy" in line or "_run_child" in line
                       for line in _lines(proc.stdout, 1)), proc.stdout


def test_a_script_that_never_initializes_fails_the_job(tmp_path):
    # Each process would run the whole program alone and exit 0: N jobs, not one.
    body = """
    print("alone")
    """
    proc, seconds = _run(tmp_path, body, "-n", "2", timeout=60)
    assert proc.returncode == launch.NOT_INITIALIZED_EXIT, proc.stdout + proc.stderr
    assert "without calling pk_jax.launch.initialize()" in proc.stdout
    assert "Call pk_jax.launch.initialize() at the top of the script" in proc.stdout
    assert seconds < 30


def test_coordinator_listens_on_the_advertised_host_only(tmp_path):
    # JAX's default binds every interface ([::]:port); the launcher advertises 127.0.0.1.
    body = """
    import os
    import pk_jax.launch
    pk_jax.launch.initialize()
    import jax
    port = int(os.environ["PK_JAX_COORDINATOR"].rsplit(":", 1)[1])
    if jax.process_index() == 0:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for row in open(table).read().splitlines()[1:]:
                local, state = row.split()[1], row.split()[3]
                address, local_port = local.split(":")
                if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                    print("listening", address)
    """
    if not Path("/proc/net/tcp").exists():
        pytest.skip("reads the listening sockets from Linux's /proc/net/tcp")
    proc, _ = _run(tmp_path, body, "-n", "2", "--timeout", "60", timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    listening = [line.split()[1] for line in _lines(proc.stdout, 0)
                 if line.startswith("listening")]
    # 127.0.0.1 (little-endian hex), or as an IPv4-mapped IPv6 address; every interface would
    # read 00000000 or 00000000000000000000000000000000.
    assert listening and set(listening) <= {"0100007F", "0000000000000000FFFF00000100007F"}, (
        proc.stdout)


def test_children_die_with_a_launcher_killed_by_sigkill(tmp_path):
    # SIGKILL leaves the launcher no chance to end its children: their parent-death signal does.
    launcher = _start_launcher(tmp_path, _SLEEPER.format(ignore_term=False, dir=str(tmp_path)),
                               "-n", "2", "--timeout", "60")
    pids = []
    try:
        pids = _child_pids(tmp_path, 2)
        launcher.kill()
        launcher.wait(timeout=10)
        assert _wait_until(lambda: not any(map(_pid_alive, pids)), 10), "children outlived it"
    finally:
        launcher.kill()
        _kill_leftovers(pids)


@pytest.mark.parametrize("second", (signal.SIGTERM, signal.SIGINT))
def test_a_second_signal_kills_the_children_at_once(tmp_path, second):
    # Children that ignore SIGTERM get the launcher's SIGKILL after its grace (5 s); a second
    # signal during the grace kills them at once.
    launcher = _start_launcher(tmp_path, _SLEEPER.format(ignore_term=True, dir=str(tmp_path)),
                               "-n", "2", "--timeout", "60")
    pids = []
    try:
        pids = _child_pids(tmp_path, 2)
        launcher.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert launcher.poll() is None and all(map(_pid_alive, pids)), "no grace"
        start = time.monotonic()
        launcher.send_signal(second)
        assert launcher.wait(timeout=10) == 130
        assert time.monotonic() - start < 2.5  # well within the 4 s of grace left
        assert _wait_until(lambda: not any(map(_pid_alive, pids)), 2), "children outlived it"
    finally:
        launcher.kill()
        _kill_leftovers(pids)


def test_timeout_ends_every_child(tmp_path):
    body = """
    import time
    print("started", flush=True)
    time.sleep(300)
    """
    proc, seconds = _run(tmp_path, body, "-n", "2", "--timeout", "2")
    assert proc.returncode == launch.TIMEOUT_EXIT, proc.stdout + proc.stderr
    assert seconds < 30
    assert "timeout after 2 s (--timeout) with ranks 0, 1 still running" in proc.stdout
    assert "started" in _lines(proc.stdout, 0) and "started" in _lines(proc.stdout, 1)


def test_timeout_names_only_the_ranks_still_running(tmp_path):
    # Rank 1 finishes, having told the launcher it joined (as initialize() does, without the
    # seconds of importing JAX and starting jax.distributed); rank 0 hangs.
    body = f"""
    import os, sys, time
    if os.environ["PK_JAX_PROCESS_ID"] == "1":
        sys.path.insert(0, {str(ROOT / "pk_jax")!r})
        import launch  # the file alone: the package would import JAX
        launch._record_joined()
    else:
        time.sleep(300)
    """
    proc, seconds = _run(tmp_path, body, "-n", "2", "--timeout", "2")
    assert proc.returncode == launch.TIMEOUT_EXIT, proc.stdout + proc.stderr
    assert "with rank 0 still running" in proc.stdout and seconds < 30


def test_a_watchdog_by_default_and_zero_for_none(monkeypatch):
    seen = []
    monkeypatch.setattr(launch, "launch", lambda command, n, **kw: seen.append(kw["timeout"]))
    launch.main(["-n", "2", "script.py"])
    launch.main(["-n", "2", "--timeout", "0", "script.py"])
    assert seen == [launch.DEFAULT_TIMEOUT_S, 0.0] and launch.DEFAULT_TIMEOUT_S == 3600.0


def test_zero_timeout_is_no_limit_and_a_negative_one_is_refused():
    # With timeout=0 read as "now", the child (which sleeps, then exits without joining a
    # job) would be timed out (124) instead of failing for not calling initialize().
    sleeper = [sys.executable, "-c", "import time; time.sleep(0.5)"]
    with open(os.devnull, "wb") as out:
        assert launch.launch(sleeper, 1, timeout=0, out=out) == launch.NOT_INITIALIZED_EXIT
        with pytest.raises(ValueError, match="--timeout"):
            launch.launch(sleeper, 1, timeout=-1, out=out)


def test_child_killed_by_a_signal(tmp_path):
    body = """
    import os, signal, time
    if os.environ["PK_JAX_PROCESS_ID"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
    """
    proc, _ = _run(tmp_path, body, "-n", "2")
    assert proc.returncode == 128 + 9, proc.stdout + proc.stderr


def test_child_env():
    cpu = launch.child_env(1, 4, "h:1", platform="cpu", share_gpu=False, mem_fraction=None,
                           base={"PK_JAX_LOCAL_DEVICE_IDS": "7"})
    assert (cpu["PK_JAX_PROCESS_ID"], cpu["PK_JAX_NUM_PROCESSES"]) == ("1", "4")
    assert (cpu["PK_JAX_COORDINATOR"] == cpu["JAX_COORDINATOR_ADDRESS"]
            == cpu["JAX_COORDINATOR_BIND_ADDRESS"] == "h:1")
    assert "PK_JAX_LOCAL_DEVICE_IDS" not in cpu and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in cpu
    assert cpu["JAX_ENABLE_PREEMPTION_SERVICE"] == "false"
    assert launch.child_env(0, 2, "h:1", platform="cpu", share_gpu=False, mem_fraction=None,
                            base={"JAX_ENABLE_PREEMPTION_SERVICE": "true"}
                            )["JAX_ENABLE_PREEMPTION_SERVICE"] == "true"
    gpu = launch.child_env(2, 4, "h:1", platform="gpu", share_gpu=False, mem_fraction=None,
                           base={})
    assert gpu["PK_JAX_LOCAL_DEVICE_IDS"] == "2" and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in gpu
    shared = launch.child_env(2, 4, "h:1", platform="gpu", share_gpu=True, mem_fraction=None,
                              base={})
    assert shared["PK_JAX_LOCAL_DEVICE_IDS"] == "0"
    assert float(shared["XLA_PYTHON_CLIENT_MEM_FRACTION"]) == pytest.approx(0.9 / 4, abs=1e-4)


def test_more_processes_than_gpus_needs_share_gpu(monkeypatch):
    monkeypatch.setattr(launch, "visible_gpus", lambda: 1)
    with pytest.raises(ValueError, match="--share-gpu"):
        launch.launch([sys.executable, "-c", "pass"], 2)


def test_initialize_without_launcher_or_cluster_does_nothing(monkeypatch):
    for var in ("PK_JAX_COORDINATOR", "SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri",
                "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    assert launch.initialize() is False


def test_initialize_rejects_bad_variables(monkeypatch):
    monkeypatch.setenv("PK_JAX_COORDINATOR", "127.0.0.1:1")
    monkeypatch.setenv("PK_JAX_NUM_PROCESSES", "two")
    monkeypatch.setenv("PK_JAX_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="PK_JAX_NUM_PROCESSES"):
        launch.initialize()
