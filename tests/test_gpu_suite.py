"""The GPU suite's driver, tests/gpu/run_all.sh, on a CPU: with a stand-in interpreter in place
of Python (PYTHON=...), its step numbering, its step selection (PK_JAX_SUITE_STEPS), its budget
(PK_JAX_SUITE_BUDGET_S), its stopping of the running step on a signal, its lanes
(tests/gpu/lanes.sh) and the shares of a step's tests (PK_JAX_TEST_SHARD, tests/conftest.py).
The GPU steps themselves run on the device (bench/results/gpu_suite_notes.md)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "gpu" / "run_all.sh"
DEFAULT_STEPS = 80  # the default sections' steps; a new step changes this count on purpose

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and GNU timeout")


def _env(**env: str) -> dict[str, str]:
    """This process's environment without the suite's own settings (steps, budget, shares, the
    GPU requirement), then `env`."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("PK_JAX_SUITE_")
           and k not in ("PK_JAX_TEST_SHARD", "PK_JAX_REQUIRE_GPU")}
    return {**out, "PYTHON": "true", **env}


def _stand_in(tmp_path: pathlib.Path, body: str) -> str:
    """An executable bash script `body`, put where run_all.sh expects Python (PYTHON=...)."""
    path = tmp_path / "stand_in_python"
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return str(path)


def _run(env: dict[str, str], *sections: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *sections], env=_env(**env), check=False,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def _numbers(out: str) -> list[int]:
    return [int(n) for n in re.findall(r"^=== \[(\d+)\] ", out, re.MULTILINE)]


def test_the_listing_numbers_every_default_step_and_runs_none():
    r = _run({"PK_JAX_SUITE_BUDGET_S": "1"})
    assert _numbers(r.stdout) == list(range(1, DEFAULT_STEPS + 1))
    assert r.stdout.count("SKIPPED (budget): ") == DEFAULT_STEPS
    assert "PASSED" not in r.stdout
    assert f"summary: 0 passed, 0 failed, {DEFAULT_STEPS} skipped (budget)" in r.stdout
    assert r.returncode != 0  # skipped steps fail the run


def test_selected_steps_run_alone_by_their_listed_numbers():
    listing = _run({"PK_JAX_SUITE_BUDGET_S": "1"}).stdout
    commands = dict(re.findall(r"^=== \[(\d+)\] (.*)$", listing, re.MULTILINE))
    r = _run({"PK_JAX_SUITE_STEPS": "4 30"})
    assert _numbers(r.stdout) == [4, 30]
    for n in ("4", "30"):
        assert f"=== [{n}] {commands[n]}" in r.stdout
        assert re.search(rf"^PASSED \(\d+ s\): {re.escape(commands[n])}$", r.stdout, re.MULTILINE)
    assert "summary: 2 passed, 0 failed, 0 skipped (budget)" in r.stdout
    assert r.returncode == 0


def test_a_failing_selected_step_fails_the_run():
    r = _run({"PK_JAX_SUITE_STEPS": "3", "PYTHON": "false"})
    assert _numbers(r.stdout) == [3]
    assert "FAILED (" in r.stdout and "summary: 0 passed, 1 failed" in r.stdout
    assert r.returncode != 0


def test_commas_select_steps_as_spaces_do():
    spaces, commas = _run({"PK_JAX_SUITE_STEPS": "4 30"}), _run({"PK_JAX_SUITE_STEPS": "4,30"})
    assert _numbers(commas.stdout) == _numbers(spaces.stdout) == [4, 30]


LANES = ROOT / "tests" / "gpu" / "lanes.sh"


def _lanes(tmp_path, python: str, *lanes: str) -> subprocess.CompletedProcess:
    env = _env(PYTHON=python, LANES_DIR=str(tmp_path / "logs"))
    return subprocess.run(["bash", str(LANES), "60", *lanes], env=env, check=False,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_lanes_run_their_own_steps_with_their_settings_and_the_budget(tmp_path):
    """tests/gpu/lanes.sh: each lane one run_all.sh with its settings, the budget as its run's
    budget and step limit, its log in LANES_DIR; the lanes' step lines printed at the end."""
    stand_in = _stand_in(tmp_path, 'echo "shard=${PK_JAX_TEST_SHARD:-none} '
                         'budget=$PK_JAX_SUITE_BUDGET_S limit=$PK_JAX_STEP_TIMEOUT"')
    r = _lanes(tmp_path, stand_in, "a:PK_JAX_SUITE_STEPS=3,4",
               "b:PK_JAX_SUITE_STEPS=4 PK_JAX_TEST_SHARD=2/3")
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = ((tmp_path / "logs" / f"{n}.log").read_text() for n in "ab")
    assert _numbers(a) == [3, 4] and _numbers(b) == [4]
    assert a.count("shard=none budget=60 limit=60") == 2
    assert b.count("shard=2/3 budget=60 limit=60") == 1
    assert r.stdout.count("##### lane ") == 2 and r.stdout.count("PASSED (") == 3


def test_a_failing_lane_fails_the_call_and_a_bad_lane_is_refused(tmp_path):
    r = _lanes(tmp_path, "true", "a:PK_JAX_SUITE_STEPS=3", "b:PK_JAX_SUITE_STEPS=4")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _lanes(tmp_path, "false", "a:PK_JAX_SUITE_STEPS=3")
    assert r.returncode == 1 and "FAILED (" in r.stdout
    for bad in ("no_settings", "a:lower=1", "a b:X=1"):
        r = _lanes(tmp_path, "true", bad)
        assert r.returncode == 2 and "lanes.sh" in r.stderr, (bad, r.stderr)


def test_numbers_follow_the_sections_named():
    r = _run({"PK_JAX_SUITE_BUDGET_S": "1"}, "tp", "unit")
    assert _numbers(r.stdout) == list(range(1, 7))  # tp's four steps, then unit's two
    assert "test_gemm_rs.py" in r.stdout.splitlines()[1]


def _alive(marker: str) -> list[int]:
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.skipif(not pathlib.Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_a_signal_to_the_script_stops_the_step_it_runs(tmp_path):
    """timeout runs the step in a process group of its own, out of reach of a signal to the
    script's group: the script must pass TERM on, or the step outlives it."""
    stand_in = _stand_in(tmp_path, "while :; do sleep 0.1; done")
    env = _env(PYTHON=stand_in, PK_JAX_SUITE_STEPS="4")
    p = subprocess.Popen(["bash", str(SCRIPT)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not _alive(stand_in) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(stand_in), "the step never started"
        os.killpg(p.pid, signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 130
        assert "stopped by a signal" in out
        deadline = time.monotonic() + 10
        while _alive(stand_in) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _alive(stand_in) == []
    finally:
        for pid in _alive(stand_in):
            os.kill(pid, signal.SIGKILL)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def _collected(path: str, shard: str | None, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """pytest --collect-only of the GPU tests of `path` (relative to the root), with the shard
    given. Run from `cwd`, outside the tree: `python -m pytest` puts its working directory on
    sys.path, and the root's pk_jax need not be the one under test (tests/conftest.py)."""
    env = _env() if shard is None else _env(PK_JAX_TEST_SHARD=shard)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--rootdir", str(ROOT), "--collect-only", "-m", "gpu",
                           str(ROOT / path)], env=env, check=False, capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def _ids(out: str) -> list[str]:
    return [line for line in out.splitlines() if "::" in line]


def test_shards_split_a_files_tests_without_overlap(tmp_path):
    """PK_JAX_TEST_SHARD=i/n (tests/conftest.py), how a step too long for one device call is
    shared by lanes or calls: the shards of a file's selected tests are disjoint, together are
    all of them, and keep their order."""
    path = "tests/test_attention_masks.py"
    collected = _collected(path, None, tmp_path)
    everything = _ids(collected.stdout)
    assert len(everything) > 10, collected.stdout + collected.stderr
    shards = [_ids(_collected(path, f"{i}/3", tmp_path).stdout) for i in (1, 2, 3)]
    assert [len(s) for s in shards] == [len(everything[i::3]) for i in range(3)]
    assert sorted(i for s in shards for i in s) == sorted(everything)
    assert shards[1] == everything[1::3]


@pytest.mark.parametrize("spec", ["0/3", "4/3", "2", "a/b"])
def test_a_bad_shard_is_a_clear_error(spec, tmp_path):
    p = _collected("tests/test_attention_masks.py", spec, tmp_path)
    assert p.returncode == 4, p.stdout + p.stderr  # pytest's usage error
    assert "PK_JAX_TEST_SHARD" in p.stdout + p.stderr and "i/n" in p.stdout + p.stderr
