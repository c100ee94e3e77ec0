"""One call of every cross-rank op at P = 2 and 4 in the rank emulator, checked; for
compute-sanitizer (memcheck, synccheck) in tests/gpu/run_all.sh section `sanitize`.
Exits non-zero on a wrong result.

    python tests/gpu/emu_short.py [OPS] [WORLDS]    e.g. gemm_rs,ag_gemm 2,4

An op may name its case's size after a colon (emu_cases.case): ring_attn:groups is the ring
forward with step groups (at P >= 4; ring_attn.cuh step_groups).

PK_JAX_EMU_SCALE_MODEL=1 runs the ranks as the scale model (World(P, scale_model=True)): the
link throttled and asynchronous (cuda/include/pk/link.cuh), so the sanitizers see the paced
stores, their drains and the per-stage deadlines as well.
"""

from __future__ import annotations

import os

# The emulator needs eager module loading, set before anything starts CUDA.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import emu_cases

from pk_jax.testing import World, ops

if __name__ == "__main__":
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else list(ops.OPS)
    worlds = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [2, 4]
    rng = np.random.default_rng(0)
    bad = []
    scale = os.environ.get("PK_JAX_EMU_SCALE_MODEL") == "1"
    for p in worlds:
        with World(p, timeout_s=float(os.environ.get("PK_JAX_TIMEOUT_S", "60")),
                   scale_model=scale) as w:
            print(f"P={p}: World({p}, scale_model={scale})", flush=True)
            for op in only:
                name, _, size = op.partition(":")
                c = ops.Call(w, emu_cases.case(name, p, rng, size=size or "small"))
                c.launch()
                w.synchronize(timeout_s=120.0)
                bad += c.check()
                c.free()
                print(f"P={p} {op}: {'ok' if not bad else bad[-1]}", flush=True)
    print("emu_short:", "OK" if not bad else f"{len(bad)} wrong", flush=True)
    sys.exit(1 if bad else 0)
