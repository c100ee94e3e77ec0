"""pk.ulysses_attention's forward and gradients across P processes, through JAX (the FFI
handlers pk_all_to_all and pk_attention of the default composed path, pk_ulysses_attn with
PK_JAX_ULYSSES_FUSED=1, or pk_ulysses_attn_bwd with PK_JAX_ULYSSES_FUSED=bwd; the Python
lowering and its attributes, which the rank emulator does not exercise).

    python -m pk_jax.launch -n 2 --share-gpu tests/gpu/ulysses_mp.py
    PK_JAX_ULYSSES_FUSED=1 python -m pk_jax.launch -n 2 --share-gpu tests/gpu/ulysses_mp.py
    PK_JAX_ULYSSES_FUSED=bwd python -m pk_jax.launch -n 2 --share-gpu tests/gpu/ulysses_mp.py

P processes share the one GPU (run_all.sh section ulysses runs P = 2, 4). First the lowered
forward is checked to take the path the environment asks for (its HLO names pk_attention and
not pk_ulysses_attn by default and with PK_JAX_ULYSSES_FUSED=bwd, pk_ulysses_attn with
PK_JAX_ULYSSES_FUSED=1, neither on CPU), and the lowered gradient to name pk_ulysses_attn_bwd
with PK_JAX_ULYSSES_FUSED=bwd and only then.
Every process builds every rank's inputs from one seed, runs pk.ulysses_attention under
jit(shard_map) on a 1-D mesh over all processes, and compares its own shard with the float32
numpy reference over the whole sequence (pk_jax.testing.ops.ulysses_attn) at bf16/fp16
tolerance. Cases: causal or not, GQA (K/V heads divisible by P, and not: repeated to
lcm(Hkv, P)), S/P not a multiple of the 128-row tile, B = 2, D 64 and 128; two calls in a row
with a pk.all_reduce between them reusing the symmetric workspace; a straggler (the last rank
sleeps 1 s). Gradients (jax.vjp through pk.ulysses_attention: by default all_to_all of dO to
the saved head shards, the pk_attention backward on the head group, all_to_all of dq, dk, dv
back; with the fused forward, all_to_all of q, dO, k, v, lse and delta first; with
PK_JAX_ULYSSES_FUSED=bwd, one pk_ulysses_attn_bwd call on dO, delta and the saved head shards;
no XLA collective) against the float32 reference gradients over the whole sequence
(pk_jax.testing.ops.ring_attn_bwd, contiguous: the same function): causal or not, GQA (K/V
heads divisible by P and not), tails, D 64 and 128, bf16 and fp16, twice in a row, a
straggler; by default and with PK_JAX_ULYSSES_FUSED=bwd all of them. With
PK_JAX_ULYSSES_FUSED=1 the forward cases all run and one gradient case (GQA with P not
dividing Hkv, causal): the fused forward, slower than the composed kernels wherever it was
measured (bench/results/overlap.md), gets the short list.

On a machine without a GPU the same script runs on CPU processes, where the op runs its
reference: a check of the script itself.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_mp import Harness


def main() -> None:
    t = Harness("ulysses_attn")
    import pk_jax as pk
    from pk_jax.testing import ops

    def forward(causal):
        return t.jit(lambda q, k, v: pk.ulysses_attention(q, k, v, "sp", causal=causal), 3)

    def case(seed, b, sl, h, hkv, d, dtype, causal, **kw):
        def reference(qs, ks, vs):
            return ops.ulysses_attn(qs, ks, vs, dtype, causal=causal).expected[t.me]["o"]

        t.check_forward(forward(causal), reference, seed, b, sl, h, hkv, d, dtype,
                        f"causal={causal}", **kw)
        progress("forward", seed)

    def grad_case(seed, b, sl, h, hkv, d, dtype, causal, **kw):
        def op(q, k, v):
            return pk.ulysses_attention(q, k, v, "sp", causal=causal)

        def reference(qs, ks, vs, dos):
            return ops.ring_attn_bwd(qs, ks, vs, dos, dtype, causal=causal)

        t.check_backward(op, reference, seed, b, sl, h, hkv, d, dtype, f"causal={causal}",
                         **kw)
        progress("gradient", seed)

    def progress(what, seed):  # at P = 4 sharing one GPU a case can take tens of seconds
        if t.me == 0:
            print(f"{what} case {seed} passed at {time.time() - t0:.1f} s", flush=True)

    mode = os.environ.get("PK_JAX_ULYSSES_FUSED", "0").strip().lower() or "0"
    gpu = pk.backend_name("attention") == "cuda"
    path = {"1": "fused", "bwd": "fused_bwd"}.get(mode, "composed") if gpu else "reference"
    check_path(t, forward(True), path)
    check_backward_path(t, lambda q, k, v: pk.ulysses_attention(q, k, v, "sp", causal=True),
                        path)

    t0 = time.time()
    count = 0
    if mode == "1":  # one gradient case through the fused forward's residuals
        grad_case(72, 1, 200, 8, 1, 128, "bfloat16", True, calls=2)
        count += 1
    else:
        for i, (b, sl, h, hkv, d, dtype) in enumerate([(1, 256, 4, 4, 128, "bfloat16"),
                                                       (2, 130, 8, 4, 64, "float16"),
                                                       (1, 200, 8, 1, 128, "bfloat16")]):
            for causal in (False, True):
                grad_case(50 + 10 * i + causal, b, sl, h, hkv, d, dtype, causal, calls=2)
                count += 1
        grad_case(93, 1, 192, 8, 2, 64, "bfloat16", True, sleep_rank=t.n - 1)
        count += 1
    for i, (b, sl, h, hkv, d, dtype) in enumerate([(1, 256, 4, 4, 128, "bfloat16"),
                                                   (2, 130, 8, 4, 64, "float16"),
                                                   (1, 200, 8, 1, 128, "bfloat16")]):
        for causal in (False, True):
            case(10 * i + causal, b, sl, h, hkv, d, dtype, causal)
            count += 1
    case(91, 1, 128, 4, 4, 64, "bfloat16", True, calls=2, between=True)
    case(92, 1, 192, 8, 4, 128, "bfloat16", True, calls=2, sleep_rank=t.n - 1)
    count += 2
    print(f"ulysses_mp OK: P={t.n}, path {path}, {count} cases in {time.time() - t0:.1f} s",
          flush=True)


def _zeros(t):
    """Sequence-sharded bf16 zeros [1, 128 P, 2 P, 128]: operands to lower with."""
    import numpy as np

    return t.place(np.zeros((1, 128 * t.n, 2 * t.n, 128), np.float32).astype(
        t.jax.numpy.bfloat16))


def check_path(t, f, path: str) -> None:
    """Asserts that the lowered forward f takes `path`: its HLO names pk_attention and not
    pk_ulysses_attn ("composed", and "fused_bwd": the composed forward), pk_ulysses_attn
    ("fused"), or neither ("reference")."""
    x = _zeros(t)
    text = f.lower(x, x, x).as_text()
    got = {name for name in ("pk_attention", "pk_ulysses_attn") if f"@{name}(" in text}
    want = {"composed": {"pk_attention"}, "fused_bwd": {"pk_attention"},
            "fused": {"pk_ulysses_attn"}, "reference": set()}[path]
    assert got == want, f"rank {t.me}: expected the {path} path, the HLO calls {sorted(got)}"
    print(f"rank {t.me}: forward path {path} (HLO calls {sorted(got)})", flush=True)


def check_backward_path(t, op, path: str) -> None:
    """Asserts that the lowered jax.vjp of op(q, k, v) names pk_ulysses_attn_bwd on the path
    "fused_bwd" (PK_JAX_ULYSSES_FUSED=bwd on GPUs) and only there; there pk_attention once
    (the forward; no pk_attention backward)."""
    jax = t.jax

    def grads(q, k, v, do):
        return jax.vjp(op, q, k, v)[1](do)

    x = _zeros(t)
    text = t.jit(grads, 4, 3).lower(x, x, x, x).as_text()
    fused = "@pk_ulysses_attn_bwd(" in text
    assert fused == (path == "fused_bwd"), (
        f"rank {t.me}: on the {path} path the gradient's HLO "
        f"{'calls' if fused else 'does not call'} pk_ulysses_attn_bwd")
    calls = text.count("@pk_attention(")
    assert not fused or calls == 1, (
        f"rank {t.me}: the gradient's HLO calls pk_attention {calls} times, expected once")
    print(f"rank {t.me}: backward {'fused' if fused else 'not fused'} (path {path})",
          flush=True)


if __name__ == "__main__":
    main()
