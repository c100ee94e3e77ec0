"""Failure cases of the rank emulator that trap the CUDA context, one per process; prints one
JSON line. Used by tests/gpu/test_emulator.py.

    python tests/gpu/emu_failures.py dead OP P   a rank never arrives: the others must fail
                                                 within the timeout, naming op, rank, peer
    python tests/gpu/emu_failures.py fresh OP P  after that process: a new world runs the op
                                                 exactly (a trapped CUDA context stays
                                                 unusable in its own process)
    python tests/gpu/emu_failures.py mbar        an mbarrier that never completes must record
                                                 code 3 and trap after the bound
"""

from __future__ import annotations

import os

# The emulator needs eager module loading, set before anything starts CUDA.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import json
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import emu_cases

from pk_jax import _ffi
from pk_jax.runtime import errors
from pk_jax.testing import EmulatorError, World, ops

TIMEOUT_S = 2.0
OP_IDS = {v: k for k, v in errors.OP_NAMES.items()}


def _fail_fields(e: EmulatorError) -> dict:
    code, op, rank, peer = e.record[:4]
    return {"failed": True, "code": code, "op": op, "rank": rank, "peer": peer,
            "elapsed_s": round(e.elapsed_s, 3), "message": str(e)}


def dead(op: str, p: int) -> dict:
    rng = np.random.default_rng(p)
    result = {"timeout_s": TIMEOUT_S, "expected_op": OP_IDS[op], "failed": False}
    w = World(p, timeout_s=TIMEOUT_S)
    dead_rank = int(rng.integers(0, p))
    result["dead"] = dead_rank
    call = ops.Call(w, emu_cases.case(op, p, rng))
    try:
        call.launch(skip=(dead_rank,))
        w.synchronize(timeout_s=TIMEOUT_S + 5.0)
    except EmulatorError as e:
        result.update(_fail_fields(e))
    w.close()
    return result


def fresh(op: str, p: int) -> dict:
    """A new world (a new process, after a failed one) runs the op exactly."""
    rng = np.random.default_rng(p + 1)
    with World(p, timeout_s=TIMEOUT_S) as w:
        good = ops.Call(w, emu_cases.case(op, p, rng))
        good.launch()
        w.synchronize()
        ok = good.check() == []
        good.free()
    return {"fresh_world_ok": ok}


def mbar() -> dict:
    result = {"timeout_s": TIMEOUT_S, "failed": False}
    w = World(2, timeout_s=TIMEOUT_S)
    try:
        _ffi._pk_ffi.emu_mbar_stall(w.parts[1].stream, w.record.device_ptr, 6, 1,
                                    int(TIMEOUT_S * 1e9))
        w.synchronize(timeout_s=TIMEOUT_S + 5.0)
    except EmulatorError as e:
        result.update(_fail_fields(e))
    w.close()
    return result


if __name__ == "__main__":
    t0 = time.monotonic()
    mode = sys.argv[1]
    out = mbar() if mode == "mbar" else {"dead": dead, "fresh": fresh}[mode](sys.argv[2],
                                                                          int(sys.argv[3]))
    out["wall_s"] = round(time.monotonic() - t0, 2)
    print(json.dumps(out), flush=True)
