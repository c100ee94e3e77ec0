"""Ring and Ulysses attention's kernels with masks across P processes (issue 38 section 3),
through JAX: the FFI handlers with their mask attributes and operands, the segment ids
all-gathered along the axis, lowering and custom VJP, which the rank emulator does not
exercise (tests/gpu/test_emulator_ring_masks.py runs the ring's masked kernel there):

- `ulysses`: ulysses_attn._composed_masked (pk.all_to_all of q, k, v to head groups, the masked
  pk.attention forward kernel over the whole sequence, all_to_all back; its VJP: dO to head
  groups, the masked pk.attention backward kernel, dq, dk, dv back); two ops and XLA between
  them, so no emulator test;
- `ring` / `ring-zigzag`: ring_attn._kernel_ring_masked (pk_ring_attn masked, the whole
  sequence's ids gathered and put in global order; its VJP the jax.lax ring's backward), in
  the contiguous or the zigzag layout.

    python -m pk_jax.launch -n 2 --share-gpu tests/gpu/sp_masked_mp.py ulysses [public]

With `public` the same cases call pk.ulysses_attention / pk.ring_attention with the masks, which
route to the same kernels on GPUs (checked in their lowering).

run_all.sh runs P = 2 and 4 (sections ulysses and ring). Every process builds the global q, k,
v, dO and masks from one seed, runs the entry under jit(shard_map) on a 1-D mesh over all
processes (q, k, v and segment ids sharded along the sequence in the layout, lengths
replicated), and compares its own shard of the output and of dq, dk, dv with tests/masks.py
dense_masked (float64 numpy over the whole sequence, on the bf16/fp16-rounded inputs): atol =
rtol = 2e-2 for the output, 2e-2 times the largest reference value (at least 1) for the
gradients; rows that no key is visible to must give exactly 0 (output and dq), keys that no
row sees exactly 0 (dk, dv). Cases: every mask alone and combined (segments crossing the
shards' boundaries, a causal sliding window, a two-sided window, the soft cap, query and key
lengths incl. 0), GQA (Ulysses: P not dividing Hkv), S/P not a multiple of 128, D 64 and 128,
bf16 and fp16; each called twice. On GPUs the ring checks its output only: its backward with
masks is the jax.lax ring's, whose ppermutes NCCL refuses with two ranks on one GPU.

Without a GPU the same script runs the public op with the masks (the jax.lax reference)
against the same dense reference: a check of the script itself.
"""

import functools
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))  # tests/: masks.py
from attn_mp import Harness


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "ulysses"
    assert what in ("ulysses", "ring", "ring-zigzag"), what
    # "public": the public op with the masks (routed to the same kernels on GPUs) instead of
    # the private entry
    via_public = sys.argv[2:] == ["public"]
    assert via_public or len(sys.argv) <= 2, sys.argv
    layout = "zigzag" if what == "ring-zigzag" else "contiguous"
    t = Harness("ulysses_attn" if what == "ulysses" else "ring_attn")
    jax, np, pk, P = t.jax, t.np, t.pk, t.P
    import jax.numpy as jnp
    from masks import dense_masked, packed_ids

    from pk_jax.ops import _attention, ring_attn, ulysses_attn
    from pk_jax.testing import ops

    gpu = pk.backend_name("attention") == "cuda"
    # The ring's backward with masks is the jax.lax ring's (ppermutes): XLA collectives, which
    # NCCL refuses with two ranks on one GPU, so on a shared GPU the ring checks its forward
    # kernel only (the backward's ring runs in the CPU tests at P = 2, 4, 8).
    grads = what == "ulysses" or not gpu
    n = t.n

    def case(seed, b, sl, h, hkv, d, dtype, *, causal=False, segments=False, window=None,
             softcap=None, q_len=None, kv_len=None, calls=2):
        s = sl * n
        rng = np.random.default_rng(seed)
        dt = ops.np_dtype(dtype)
        glob = [rng.standard_normal(shape).astype(np.float32).astype(dt)
                for shape in ((b, s, h, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, h, d))]
        ids = packed_ids(b, s, seed, mean=max(2, sl // 3)) if segments else None
        lens = {"q_len": q_len, "kv_len": kv_len}
        arrays = {k: np.asarray(x, np.int32) for k, x in lens.items() if x is not None}
        if ids is not None:
            arrays["ids"] = ids
        specs = {k: (t.seq if k == "ids" else P()) for k in arrays}
        scale = d ** -0.5

        def op(q, k, v, a):
            masks = _attention.Masks(a.get("ids"), a.get("ids"), a.get("q_len"), a.get("kv_len"))
            public = {"causal": causal, "scale": scale, "segment_ids": a.get("ids"),
                      "local_window_size": window, "logits_soft_cap": softcap,
                      "query_seq_lengths": a.get("q_len"),
                      "key_value_seq_lengths": a.get("kv_len")}
            if what == "ulysses":
                if via_public or not gpu:  # without a GPU: the public op's reference
                    return pk.ulysses_attention(q, k, v, "sp", **public)
                return ulysses_attn._composed_masked(q, k, v, "sp", masks, scale, causal,
                                                     window, softcap)
            if via_public or not gpu:
                return pk.ring_attention(q, k, v, "sp", layout=layout, **public)
            return ring_attn._kernel_ring_masked(q, k, v, "sp", masks, scale, causal, window,
                                                 softcap, layout=layout)

        def body(q, k, v, do, a):
            if not grads:
                return (op(q, k, v, a),)
            o, pull = jax.vjp(lambda *x: op(*x, a), q, k, v)
            return (o, *pull(do))

        f = jax.jit(jax.shard_map(body, mesh=t.mesh, in_specs=(t.seq,) * 4 + (specs,),
                                  out_specs=(t.seq,) * (4 if grads else 1)))
        want_o, want_g = dense_masked(*glob[:3], causal=causal, scale=scale, segment_ids=ids,
                                      window=window, softcap=softcap, q_len=q_len,
                                      kv_len=kv_len, w=glob[3].astype(np.float64))
        # the layout: rank r holds global positions idx[r S/P .. (r+1) S/P)
        idx = pk.zigzag_indices(s, n) if layout == "zigzag" and what != "ulysses" \
            else np.arange(s)
        rows = idx[t.me * sl:(t.me + 1) * sl]
        want = [want_o[:, rows]] + [g[:, rows] for g in want_g]
        vis = _visible(np, b, s, causal, ids, window, q_len, kv_len)
        dead_rows = ~vis.any(2)[:, rows]   # [B, S/P]: rows no key is visible to
        dead_keys = ~vis.any(1)[:, rows]   # keys no row sees
        placed = [t.place(x[:, idx]) for x in glob]
        laid = {k: (x[:, idx] if k == "ids" else x) for k, x in arrays.items()}
        mesh_arrays = {k: t.place(x, specs[k]) for k, x in laid.items()}
        where = (f"rank {t.me}: {what} b={b} S/P={sl} h={h} hkv={hkv} d={d} {dtype} causal={causal} "
                f"segments={segments} window={window} softcap={softcap} q_len={q_len} "
                f"kv_len={kv_len}")
        for c in range(calls):
            got = [t.local(y).astype(np.float64) for y in f(*placed, mesh_arrays)]
            for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
                big = 1.0 if name == "o" else max(1.0, float(np.abs(w).max()))
                if not (np.all(np.isfinite(g)) and np.allclose(g, w, atol=2e-2 * big,
                                                               rtol=2e-2)):
                    raise AssertionError(f"{where} call {c}: {name} differs (max error "
                                         f"{np.nanmax(np.abs(g - w))})")
            for name, g, dead in list(zip(("o", "dq", "dk", "dv"), got,
                                          (dead_rows, dead_rows, dead_keys, dead_keys))):
                if np.any(g[dead] != 0):
                    raise AssertionError(f"{where} call {c}: {name} not exactly 0 where no pair "
                                         "is visible")
        if t.me == 0:
            print(f"case {seed} passed at {time.time() - t0:.1f} s", flush=True)

    if gpu:
        check_lowering(t, jnp, _attention, ulysses_attn, ring_attn, what, layout, via_public)
    t0 = time.time()
    case(1, 2, 200, 2 * n, n, 64, "bfloat16", segments=True)
    case(2, 1, 256, 2 * n, n, 128, "bfloat16", segments=True, causal=True)
    case(3, 1, 192, 4 * n, 1, 64, "float16", window=(100, 0), causal=True)
    case(4, 2, 130, n, n, 128, "bfloat16", window=(40, 70))
    case(5, 1, 160, 2 * n, 2 * n, 64, "bfloat16", softcap=20.0)
    case(6, 2, 150, n, n, 128, "float16", q_len=[150 * n - 77, 0], kv_len=[60, 150 * n])
    case(7, 2, 256, 2 * n, 2, 128, "bfloat16", segments=True, causal=True, window=(300, 0),
         softcap=30.0, q_len=[256 * n - 5, 200], kv_len=[256 * n, 190])
    case(8, 1, 100, 2 * n, n, 64, "float16", segments=True, softcap=5.0, kv_len=[100 * n - 30])
    count = 8
    print(f"sp_masked_mp OK: {what}{' (public op)' if via_public else ''}, P={n}, "
          f"{'kernels' if gpu else 'reference (no GPU)'}, "
          f"{count} cases in {time.time() - t0:.1f} s", flush=True)


def _visible(np, b, s, causal, ids, window, q_len, kv_len):
    """bool [B, S, S]: query i sees key j under the masks (as dense_masked)."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    vis = np.ones((b, s, s), bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    if ids is not None:
        vis &= ids[:, :, None] == ids[:, None, :]
    if q_len is not None:
        vis &= i[None] < np.asarray(q_len)[:, None, None]
    if kv_len is not None:
        vis &= j[None] < np.asarray(kv_len)[:, None, None]
    return vis


def check_lowering(t, jnp, _attention, ulysses_attn, ring_attn, what, layout,
                   via_public=False) -> None:
    """The lowered entry (or public op) and its gradient: Ulysses calls pk_attention twice
    (forward and backward) with masked = 1 and pk_all_to_all; the ring calls pk_ring_attn once
    with masked = 1 (its backward is the jax.lax ring's)."""
    jax, np = t.jax, t.np
    x = t.place(np.zeros((1, 128 * t.n, 2 * t.n, 64), np.float32).astype(jnp.bfloat16))

    def body(q, ids):
        masks = _attention.Masks(ids, ids, None, None)
        if via_public:
            op = t.pk.ulysses_attention if what == "ulysses" else functools.partial(
                t.pk.ring_attention, layout=layout)
            f = lambda q: op(q, q, q, "sp", causal=True, scale=0.125, segment_ids=ids)
        elif what == "ulysses":
            f = lambda q: ulysses_attn._composed_masked(q, q, q, "sp", masks, 0.125, True)
        else:
            f = lambda q: ring_attn._kernel_ring_masked(q, q, q, "sp", masks, 0.125, True,
                                                        layout=layout)
        o, pull = jax.vjp(f, q)
        return o, pull(o)[0]

    ids = t.place(np.zeros((1, 128 * t.n), np.int32))
    text = jax.jit(jax.shard_map(body, mesh=t.mesh, in_specs=(t.seq, t.seq),
                                 out_specs=(t.seq, t.seq))).lower(x, ids).as_text()
    target, want = ("pk_attention", 2) if what == "ulysses" else ("pk_ring_attn", 1)
    calls = text.count(f"@{target}(")
    assert calls == want, (f"rank {t.me}: the masked {what} path's HLO calls {target} "
                           f"{calls} times (expected {want})")
    assert what != "ulysses" or "@pk_all_to_all(" in text, f"rank {t.me}: no pk_all_to_all"
    assert "masked = 1" in text, f"rank {t.me}: {target} not called with masked = 1"
    print(f"rank {t.me}: masked {what} path lowered to {want} {target} call(s)", flush=True)


if __name__ == "__main__":
    main()
