"""The launcher: N CPU processes of one jax.distributed job, rank-prefixed output, failures and
timeouts that end the whole job without leaving processes behind."""

from __future__ import annotations

import os
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
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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


def test_a_rank_that_raises_ends_the_job_within_seconds(tmp_path):
    # Without the launcher's exception hook, the failing rank waits in JAX's distributed
    # shutdown until the healthy rank finishes (here two minutes).
    body = """
    import time
    import pk_jax.launch
    pk_jax.launch.initialize()
    import jax
    jax.devices()
    if jax.process_index() == 1:
        print("failing at", time.time(), flush=True)
        raise RuntimeError("rank one fails")
    time.sleep(120)
    """
    proc, _ = _run(tmp_path, body, "-n", "2", "--timeout", "150")
    end = time.time()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [failed_at] = [float(line.split()[-1]) for line in _lines(proc.stdout, 1)
                   if line.startswith("failing at")]
    # Within the launcher's SIGTERM grace (5 s): the healthy rank ends on SIGTERM (JAX's
    # preemption service, which would catch it, is off in the children).
    assert end - failed_at < 4, proc.stdout
    assert "SIGTERM caught" not in proc.stdout, proc.stdout
    assert "RuntimeError: rank one fails" in _lines(proc.stdout, 1)
    assert "rank 1 exited with status 1" in proc.stdout


def test_timeout_ends_every_child(tmp_path):
    body = """
    import time
    print("started", flush=True)
    time.sleep(300)
    """
    proc, seconds = _run(tmp_path, body, "-n", "2", "--timeout", "2")
    assert proc.returncode == launch.TIMEOUT_EXIT, proc.stdout + proc.stderr
    assert seconds < 30
    assert "timeout after 2 s" in proc.stdout
    assert "started" in _lines(proc.stdout, 0) and "started" in _lines(proc.stdout, 1)


def test_child_killed_by_a_signal(tmp_path):
    body = """
    import os, signal
    if os.environ["PK_JAX_PROCESS_ID"] == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    """
    proc, _ = _run(tmp_path, body, "-n", "2")
    assert proc.returncode == 128 + 9, proc.stdout + proc.stderr


def test_child_env():
    cpu = launch.child_env(1, 4, "h:1", platform="cpu", share_gpu=False, mem_fraction=None,
                           base={"PK_JAX_LOCAL_DEVICE_IDS": "7"})
    assert (cpu["PK_JAX_PROCESS_ID"], cpu["PK_JAX_NUM_PROCESSES"]) == ("1", "4")
    assert cpu["PK_JAX_COORDINATOR"] == cpu["JAX_COORDINATOR_ADDRESS"] == "h:1"
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
