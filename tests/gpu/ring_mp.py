"""pk.ring_attention's forward across P processes, through JAX (the FFI handler pk_ring_attn,
the Python lowering and its attributes, which the rank emulator does not exercise).

    python -m pk_jax.launch -n 2 --share-gpu tests/gpu/ring_mp.py

P processes share the one GPU (run_all.sh section ring runs P = 2, 4). Every process builds
every rank's inputs from one seed, runs pk.ring_attention under jit(shard_map) on a 1-D mesh
over all processes, and compares its own shard with the float32 numpy reference over the whole
sequence (pk_jax.testing.ops.ring_attn) at bf16/fp16 tolerance. Cases: causal or not, zigzag
or contiguous, GQA, S/P not a multiple of the 128-row tile, B = 2, D 64 and 128; two calls in a
row with a pk.all_reduce between them reusing the symmetric workspace; a straggler (the last
rank sleeps 1 s). Gradients (the fused backward, pk_ring_attn_bwd: no XLA collective) of
jax.vjp through pk.ring_attention against the float32 reference gradients
(pk_jax.testing.ops.ring_attn_bwd): causal or not, zigzag or contiguous, GQA, tails, twice.

On a machine without a GPU the same script runs on CPU processes, where the op runs its
reference: a check of the script itself.
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_mp import Harness


def main() -> None:
    t = Harness("ring_attn")

    import pk_jax as pk
    from pk_jax.testing import ops

    def forward(causal, layout):
        return t.jit(lambda q, k, v: pk.ring_attention(q, k, v, "sp", causal=causal,
                                                       layout=layout), 3)

    def case(seed, b, sl, h, hkv, d, dtype, causal, layout, **kw):
        def reference(qs, ks, vs):
            return ops.ring_attn(qs, ks, vs, dtype, causal=causal,
                                 zigzag=layout == "zigzag").expected[t.me]["o"]

        t.check_forward(forward(causal, layout), reference, seed, b, sl, h, hkv, d, dtype,
                        f"causal={causal} {layout}", **kw)

    def grad_case(seed, b, sl, h, hkv, d, dtype, causal, layout, **kw):
        def op(q, k, v):
            return pk.ring_attention(q, k, v, "sp", causal=causal, layout=layout)

        def reference(qs, ks, vs, dos):
            return ops.ring_attn_bwd(qs, ks, vs, dos, dtype, causal=causal,
                                     zigzag=layout == "zigzag")

        t.check_backward(op, reference, seed, b, sl, h, hkv, d, dtype,
                         f"causal={causal} {layout}", **kw)

    t0 = time.time()
    count = 0
    for i, (b, sl, h, hkv, d, dtype) in enumerate([(1, 256, 4, 4, 128, "bfloat16"),
                                                   (1, 130, 8, 2, 64, "float16")]):
        for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag")):
            grad_case(50 + 10 * i + 2 * causal + (layout == "zigzag"), b, sl, h, hkv, d, dtype,
                      causal, layout, calls=2)
            count += 1
    for i, (b, sl, h, hkv, d, dtype) in enumerate([(1, 256, 4, 4, 128, "bfloat16"),
                                                   (2, 130, 8, 2, 64, "float16"),
                                                   (1, 200, 4, 1, 128, "bfloat16")]):
        for causal, layout in ((False, "contiguous"), (True, "contiguous"), (True, "zigzag")):
            case(10 * i + 2 * causal + (layout == "zigzag"), b, sl, h, hkv, d, dtype, causal,
                 layout)
            count += 1
    case(91, 1, 128, 4, 2, 64, "bfloat16", True, "zigzag", calls=2, between=True)
    case(92, 1, 192, 4, 4, 128, "bfloat16", True, "contiguous", calls=2, sleep_rank=t.n - 1)
    count += 2
    print(f"ring_mp OK: P={t.n}, {count} cases in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
