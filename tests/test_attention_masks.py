"""The masks inside the pk.attention kernels (issue 38 section 2).

On a CPU: the mask functions the kernels run (cuda/include/pk/attn/masks.cuh), built with the
host compiler into tests/cpp/masks.cc, against NumPy for random shapes and masks: each row's
keys and each key's rows, the element predicate, the key tiles of a query tile and the query
tiles of a key block (never skipping a tile with a visible pair, exact where the masks are
positional), which sub-tiles may leave out their element masks, rows that see no key, and the
soft cap's tanh; the segment operands the Python entry builds (`attention.segment_info`); and the
private entry `attention._kernel_attention_masked` (where pk.attention's masked calls go on
the GPU; the routing is checked in tests/test_attention.py): its pk_attention calls and its
trace-time errors.

On an H200 (marker gpu): the masked kernels' forward and gradients through
`_kernel_attention_masked` against the float32 reference (pk_jax/ops/_attention.py), every mask
alone and combined, D 64 and 128, GQA, odd S, segments across tile boundaries, rows and keys no
pair sees (exact zeros), poisoned outputs and two calls in a row; and pk.attention with the
masks as a user passes them.
"""

from __future__ import annotations

import functools
import pathlib
import shutil
import subprocess
import tempfile
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from masks import packed_ids
from util import poison

import pk_jax as pk
from pk_jax.ops import _attention
from pk_jax.ops import attention as att

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHUNK = 64  # masks.cuh CHUNK
PAD = 128  # the segment operands' padding (attention._PAD)


# ---------------------------------------------------------------------------------------------
# NumPy: the masks from their definitions (pk_jax/ops/_attention.py tile_mask).

def np_positional(s, q_len, kv_len, left, right, causal) -> np.ndarray:
    """bool [S, S]: row i sees key j by position (lengths as given; window None: none)."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    vis = (i < q_len) & (j < kv_len)
    if causal:
        vis &= j <= i
    if left is not None:
        vis &= (j >= i - left) & (j <= i + right)
    return vis


def np_visible(case) -> np.ndarray:
    vis = np_positional(case["s"], case["q_len"], case["kv_len"], case["left"], case["right"],
                        case["causal"])
    if case["q_seg"] is not None:
        vis &= case["q_seg"][:, None] == case["kv_seg"][None, :]
    return vis


def np_segment_info(q_seg, kv_seg):
    """Brute force of attention.segment_info for one batch row: padded ids and per chunk (min,
    max, first, end)."""
    s = len(q_seg)
    sp = -(-s // PAD) * PAD
    qp, kp = (np.concatenate([x, np.full(sp - s, x[-1])]) for x in (q_seg, kv_seg))
    n = sp // CHUNK
    rq = [(qp[c * CHUNK:(c + 1) * CHUNK].min(), qp[c * CHUNK:(c + 1) * CHUNK].max())
          for c in range(n)]
    rk = [(kp[c * CHUNK:(c + 1) * CHUNK].min(), kp[c * CHUNK:(c + 1) * CHUNK].max())
          for c in range(n)]

    def info(mine, other):
        rows = []
        for lo, hi in mine:
            meet = [c for c, (a, b) in enumerate(other) if lo <= b and a <= hi]
            rows.append((lo, hi, meet[0], meet[-1] + 1) if meet else (lo, hi, 0, 0))
        return np.array(rows, np.int64)

    return qp, kp, info(rq, rk), info(rk, rq)


# ---------------------------------------------------------------------------------------------
# tests/cpp/masks.cc, built once per session.

class MasksProgram:
    _shared = None

    @classmethod
    def get(cls) -> MasksProgram:
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def __init__(self):
        cxx = shutil.which("g++") or shutil.which("c++")
        if cxx is None:
            pytest.skip("needs a C++ compiler")
        out = pathlib.Path(tempfile.mkdtemp(prefix="pk_jax_masks_"))
        program = out / "masks"
        subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror",
                        f"-I{ROOT / 'cuda' / 'include'}", str(ROOT / "tests" / "cpp" / "masks.cc"),
                        "-o", str(program)], check=True)
        self.proc = subprocess.Popen([str(program)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().rstrip("\n")
        assert not answer.startswith("error"), answer
        return answer

    def ints(self, line: str) -> np.ndarray:
        return np.array(self.ask(line).split(), np.int64)

    def bits(self, line: str) -> np.ndarray:
        return np.frombuffer(self.ask(line).encode(), np.uint8) == ord("1")

    def set_case(self, case) -> None:
        s = case["s"]
        left = s if case["left"] is None else case["left"]
        right = s if case["right"] is None else case["right"]
        assert self.ask(f"pos {s} {case['q_len']} {case['kv_len']} {left} {right} "
                        f"{int(case['causal'])}") == "ok"
        if case["q_seg"] is not None:
            for side, info in (("q", case["q_info"]), ("kv", case["kv_info"])):
                flat = " ".join(map(str, np.asarray(info).reshape(-1)))
                assert self.ask(f"info {side} {len(info)} {flat}") == "ok"


def random_case(rng, s=None) -> dict:
    """Random S, lengths (0, S, past S, negative), window (none, (0, 0), random), causal and
    segment ids (none, packed, unsorted, q and kv apart with ids no key has)."""
    s = int(s if s is not None else rng.choice([1, 2, 37, 63, 64, 65, 127, 128, 129, 200, 257,
                                                 300, 383, 450, 640]))
    lens = lambda: int(rng.choice([s, s, 0, s + 7, -3, rng.integers(0, s + 1)]))
    window = rng.choice(["none", "none", "zero", "random", "causal"])
    left = right = None
    if window == "zero":
        left = right = 0
    elif window == "random":
        left, right = int(rng.integers(0, s + 2)), int(rng.integers(0, s + 2))
    elif window == "causal":
        left, right = int(rng.integers(0, 200)), 0
    kind = rng.choice(["none", "packed", "packed", "unsorted", "apart"])
    q_seg = kv_seg = None
    if kind == "packed":
        q_seg = kv_seg = packed_ids(1, s, int(rng.integers(1 << 30)), mean=int(rng.choice(
            [3, 40, 100])))[0]
    elif kind == "unsorted":
        q_seg = kv_seg = rng.integers(0, 3, s).astype(np.int32)
    elif kind == "apart":
        q_seg = packed_ids(1, s, int(rng.integers(1 << 30)), mean=60)[0]
        kv_seg = np.where(q_seg % 3 == 1, q_seg + 1, q_seg).astype(np.int32)  # ids no key has
    case = {"s": s, "q_len": lens(), "kv_len": lens(), "left": left, "right": right,
            "causal": bool(rng.integers(2)), "q_seg": q_seg, "kv_seg": kv_seg}
    if q_seg is not None:
        _, _, case["q_info"], case["kv_info"] = np_segment_info(q_seg, kv_seg)
    return case


def _clamp(n, s):
    return min(max(n, 0), s)


def _tiles_with_visible(vis: np.ndarray, rows: int, keys: int) -> np.ndarray:
    """bool [row tiles, key tiles]: the tile holds a visible pair."""
    s = vis.shape[0]
    nr, nk = -(-s // rows), -(-s // keys)
    out = np.zeros((nr, nk), bool)
    for a in range(nr):
        for b in range(nk):
            out[a, b] = vis[a * rows:(a + 1) * rows, b * keys:(b + 1) * keys].any()
    return out


def _hull(flags: np.ndarray) -> tuple[int, int]:
    idx = np.flatnonzero(flags)
    return (int(idx[0]), int(idx[-1]) + 1) if len(idx) else (0, 0)


CASES = [random_case(np.random.default_rng(seed)) for seed in range(60)]


def _case_id(case) -> str:
    seg = "none" if case["q_seg"] is None else (
        "apart" if case["q_seg"] is not case["kv_seg"] else "ids")
    win = "none" if case["left"] is None else f"{case['left']},{case['right']}"
    return (f"S{case['s']}-q{case['q_len']}-kv{case['kv_len']}-w{win}-"
            f"{'causal' if case['causal'] else 'full'}-{seg}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_rows_keys_and_the_predicate_match_numpy(case):
    """keys_of_row and rows_of_key are each row's and key's visible positions, contiguous (the
    positional masks), empty past the lengths; `visible` is the positional mask."""
    prog = MasksProgram.get()
    prog.set_case(case)
    s = case["s"]
    vis = np_positional(s, case["q_len"], case["kv_len"], case["left"], case["right"],
                        case["causal"])
    spans = prog.ints("keys_of_row").reshape(s, 2)
    for i, (lo, hi) in enumerate(spans):
        got = np.zeros(s, bool)
        got[max(lo, 0):max(hi, lo)] = True
        np.testing.assert_array_equal(got, vis[i], err_msg=f"row {i}")
    spans = prog.ints("rows_of_key").reshape(s, 2)
    for j, (lo, hi) in enumerate(spans):
        got = np.zeros(s, bool)
        got[max(lo, 0):max(hi, lo)] = True
        np.testing.assert_array_equal(got, vis[:, j], err_msg=f"key {j}")
    np.testing.assert_array_equal(prog.bits("visible").reshape(s, s), vis)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_tile_ranges_never_skip_a_visible_pair(case):
    """The forward's key tiles (query tiles of 128 and 192 rows, key tiles of 128) and the
    backward's query tiles (key blocks of 128, query tiles of 64) hold every tile with a
    visible pair, segments included; with positional masks only, or packed documents alone,
    they are exactly the hull of those tiles; a query tile past q_len (rows that see no key)
    and a key block past kv_len stream nothing."""
    prog = MasksProgram.get()
    prog.set_case(case)
    s, seg = case["s"], case["q_seg"] is not None
    vis = np_visible(case)
    positional_only = not seg
    packed_alone = (seg and case["q_seg"] is case["kv_seg"] and case["left"] is None
                    and not case["causal"] and _clamp(case["q_len"], s) == s
                    and _clamp(case["kv_len"], s) == s
                    and np.all(np.diff(case["q_seg"]) >= 0))
    for bm in (128, 192):
        spans = prog.ints(f"fwd_tiles {int(seg)} {bm} 128").reshape(-1, 2)
        need = _tiles_with_visible(vis, bm, 128)
        assert len(spans) == len(need)
        for t, ((lo, hi), row) in enumerate(zip(spans, need)):
            for kt in np.flatnonzero(row):
                assert lo <= kt < hi, (bm, t, kt, lo, hi)
            if positional_only or packed_alone:
                assert (lo, hi) == _hull(row) or (hi <= lo and not row.any()), (bm, t, lo, hi)
            if t * bm >= _clamp(case["q_len"], s):
                assert hi <= lo, (bm, t, lo, hi)
    spans = prog.ints(f"bwd_tiles {int(seg)} 128 64").reshape(-1, 2)
    need = _tiles_with_visible(vis.T, 128, 64)  # key blocks by query tiles
    assert len(spans) == len(need)
    for t, ((lo, hi), col) in enumerate(zip(spans, need)):
        for qt in np.flatnonzero(col):
            assert lo <= qt < hi, (t, qt, lo, hi)
        if positional_only or packed_alone:
            assert (lo, hi) == _hull(col) or (hi <= lo and not col.any()), (t, lo, hi)
        if t * 128 >= _clamp(case["kv_len"], s):
            assert hi <= lo, (t, lo, hi)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_element_masks_are_left_out_only_where_every_pair_is_visible(case):
    """needs_mask for the forward's sub-tiles (a warpgroup's 64 rows by 128 keys, rows past S
    included) and the backward's (64 keys by 64 rows): a sub-tile without element masks has
    every pair visible (segments included), and one whose pairs are all visible by position and
    in one segment leaves them out."""
    prog = MasksProgram.get()
    prog.set_case(case)
    s, seg = case["s"], case["q_seg"] is not None
    vis = np_visible(case)
    for nr, nk in ((64, 128), (64, 64)):
        r_end = -(-s // 192) * 192
        need = prog.bits(f"needs_mask {int(seg)} {nr} {nk} {r_end}").reshape(-1, -(-s // nk))
        for a, r0 in enumerate(range(0, r_end, nr)):
            for b, k0 in enumerate(range(0, s, nk)):
                rows, keys = np.arange(r0, r0 + nr), np.arange(k0, k0 + nk)
                inside = (rows[:, None] < s) & (keys[None, :] < s)
                sub = np.zeros((nr, nk), bool)
                sub[inside] = vis[np.minimum(rows, s - 1)[:, None],
                                  np.minimum(keys, s - 1)[None, :]][inside]
                if not need[a, b]:
                    assert sub.all(), (nr, nk, r0, k0)
                elif sub.all() and inside.all():
                    ids = None if not seg else np.concatenate(
                        [case["q_seg"][r0:r0 + nr], case["kv_seg"][k0:k0 + nk]])
                    assert seg and np.unique(ids).size > 1, (nr, nk, r0, k0)


def test_the_cases_cover_the_edges():
    """The random cases above include rows that see no key, keys no row sees, empty tile
    ranges, windows, segments across chunks, and sub-tiles that skip their element masks."""
    kinds = set()
    for case in CASES:
        vis = np_visible(case)
        kinds.add("row sees nothing" if (~vis.any(1)).any() else "")
        kinds.add("key seen by nothing" if (~vis.any(0)).any() else "")
        kinds.add("window" if case["left"] is not None else "")
        kinds.add("causal" if case["causal"] else "")
        if case["q_seg"] is not None and case["s"] > CHUNK:
            ids = case["q_seg"]
            if (ids[CHUNK - 1::CHUNK][:-1] == ids[CHUNK::CHUNK][:len(ids[CHUNK - 1::CHUNK]) - 1]
                    ).any():
                kinds.add("segment across chunks")
        if not np_visible(case).any():
            kinds.add("nothing visible")
    assert {"row sees nothing", "key seen by nothing", "window", "causal",
            "segment across chunks", "nothing visible"} <= kinds


def test_tanh_fast_matches_numpy():
    """The soft cap's tanh (forward and backward), within 2e-7 absolute over the floats a
    capped score meets, including 0, tiny, large and negative ones."""
    x = np.concatenate([np.linspace(-12, 12, 2001), [0.0, 1e-30, -1e-7, 3e-4, 40, -80, 1e4]])
    x = x.astype(np.float32)
    answer = MasksProgram.get().ask("tanh " + " ".join(f"{v:.9g}" for v in x))
    got = np.array(answer.split(), np.float64)
    np.testing.assert_allclose(got, np.tanh(x.astype(np.float64)), atol=2e-7, rtol=0)
    assert np.all(np.abs(got) <= 1)


# ---------------------------------------------------------------------------------------------
# The Python entry's operands and calls.

@pytest.mark.parametrize("seed", range(6))
def test_segment_info_matches_brute_force(seed):
    """Packed ids in one batch row, unsorted (negative too) in the other, kv ids apart."""
    rng = np.random.default_rng(seed)
    b, s = 2, int(rng.choice([5, 64, 129, 300, 513]))
    q_seg = np.stack([packed_ids(1, s, seed)[0], rng.integers(-2, 3, s)]).astype(np.int32)
    kv_seg = np.where(q_seg % 4 == 3, q_seg + 1, q_seg).astype(np.int32)
    got = [np.asarray(x) for x in att.segment_info(jnp.asarray(q_seg, jnp.int32),
                                                   jnp.asarray(kv_seg, jnp.int32))]
    for r in range(b):
        want = np_segment_info(q_seg[r].astype(np.int64), kv_seg[r].astype(np.int64))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g[r], w)
    sp = -(-s // PAD) * PAD
    assert [x.shape for x in got] == [(b, sp), (b, sp), (b, sp // CHUNK, 4),
                                      (b, sp // CHUNK, 4)]
    assert all(x.dtype == np.int32 for x in got)


def _attrs(e) -> dict:
    return {k: (float(v) if k in ("scale", "soft_cap") else int(v))
            for k, v in dict(e.params["attributes"]).items()}


def _pk_calls(jaxpr) -> list:
    from test_ring_attn import ffi_calls

    return [e for e in ffi_calls(jaxpr) if e.params["target_name"] == "pk_attention"]


def test_masked_entry_calls_pk_attention_with_the_masks():
    """_kernel_attention_masked traces to one masked pk_attention forward and one backward:
    the attributes (window, cap, segments), the lengths (S where not given), the padded ids and
    chunk ranges after the pass's own operands, lse and delta padded to 128; gradients in the
    operands' shapes and dtypes."""
    b, s, h, hkv, d = 2, 300, 8, 2, 64
    q = jnp.zeros((b, s, h, d), jnp.bfloat16)
    kv = jnp.zeros((b, s, hkv, d), jnp.bfloat16)
    ids = jnp.asarray(packed_ids(b, s, 3, mean=70))
    masks = _attention.Masks(ids, ids, jnp.array([300, 120], jnp.int32), None)

    def loss(q, k, v):
        o = att._kernel_attention_masked(q, k, v, masks, 0.125, True, (64, 0), 30.0)
        return jnp.sum(o.astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
    fwd, bwd = _pk_calls(jaxpr)
    want = {"scale": 0.125, "causal": 1, "masked": 1, "window_left": 64, "window_right": 0,
            "soft_cap": 30.0, "segments": 1}
    assert _attrs(fwd) == {**want, "backward": 0} and _attrs(bwd) == {**want, "backward": 1}
    masked_operands = [((b,), jnp.int32), ((b,), jnp.int32), ((b, 384), jnp.int32),
                       ((b, 384), jnp.int32), ((b, 6, 4), jnp.int32), ((b, 6, 4), jnp.int32)]
    shapes = lambda xs: [(x.aval.shape, x.aval.dtype) for x in xs]
    assert shapes(fwd.invars) == [(q.shape, q.dtype), (kv.shape, kv.dtype),
                                  (kv.shape, kv.dtype)] + masked_operands
    assert shapes(bwd.invars)[3:] == [(q.shape, q.dtype), ((b, h, 384), jnp.float32),
                                      ((b, h, 384), jnp.float32)] + masked_operands
    assert shapes(fwd.outvars) == [(q.shape, q.dtype), ((b, h, s), jnp.float32)]
    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, q.dtype), (kv.shape, kv.dtype),
                                                   (kv.shape, kv.dtype)]


def test_masked_entry_without_segments_or_window():
    """Lengths alone: two int32 operands, segments 0, the window (S, S) and cap 0 (none)."""
    q = jnp.zeros((1, 200, 4, 128), jnp.float16)
    masks = _attention.Masks(None, None, None, jnp.array([150], jnp.int32))
    jaxpr = jax.make_jaxpr(lambda q: att._kernel_attention_masked(q, q, q, masks, 0.1, False))(q)
    (fwd,) = _pk_calls(jaxpr)
    assert _attrs(fwd) == {"scale": pytest.approx(0.1), "causal": 0, "backward": 0, "masked": 1,
                           "window_left": 200, "window_right": 200, "soft_cap": 0.0,
                           "segments": 0}
    assert [x.aval.shape for x in fwd.invars[3:]] == [(1,), (1,)]


def test_unmasked_calls_pass_every_attribute_with_masked_0(monkeypatch):
    """pk_attention's Bind() lists the mask attributes, so the unmasked calls (pk.attention, and
    ring / Ulysses through _forward_call and backward_call) pass them too, masked 0."""
    from pk_jax import _backend

    monkeypatch.setattr(_backend, "use_kernel", lambda stem, axis_name=None: True)
    q = jnp.zeros((1, 100, 2, 64), jnp.bfloat16)
    grad = jax.grad(lambda q: jnp.sum(pk.attention(q, q, q).astype(jnp.float32)))
    calls = _pk_calls(jax.make_jaxpr(grad)(q))
    assert len(calls) == 2
    for e in calls:
        a = _attrs(e)
        assert (a["masked"], a["segments"], a["soft_cap"]) == (0, 0, 0.0)
        assert set(a) == {"scale", "causal", "backward", "masked", "window_left", "window_right",
                          "soft_cap", "segments"}
        assert len(e.invars) == (6 if a["backward"] else 3)


@pytest.mark.parametrize("args,msg", [
    ({"dtype": jnp.float32}, "bf16 or fp16"),
    ({"d": 96}, "head_dim"),
    ({"masks": _attention.Masks(None, None, jnp.zeros((3,), jnp.int32), None)},
     r"masks.q_len must be an integer array of shape \(2,\)"),
    ({"masks": _attention.Masks(jnp.zeros((2, 40), jnp.int32), None, None, None)},
     "given together"),
    ({"masks": _attention.Masks(jnp.zeros((2, 40), jnp.float32),
                                jnp.zeros((2, 40), jnp.float32), None, None)},
     "masks.q_seg must be an integer array"),
    ({"window": (-1, 3)}, r"window must be \(left, right\) >= 0"),
    ({"softcap": 0.0}, "softcap must be a finite positive"),
])
def test_masked_entry_errors_at_trace_time(args, msg):
    d = args.get("d", 64)
    q = jnp.zeros((2, 40, 4, d), args.get("dtype", jnp.bfloat16))
    with pytest.raises(ValueError, match=r"pk.attention \(masked kernels\): .*" + msg):
        jax.make_jaxpr(lambda q: att._kernel_attention_masked(
            q, q, q, args.get("masks"), 0.125, False, args.get("window"),
            args.get("softcap")))(q)


# ---------------------------------------------------------------------------------------------
# GPU: the masked kernels against the float32 reference.
#
# Each case runs `_kernel_attention_masked` jitted, twice, every output poisoned first (a
# NaN-filled array of its size allocated and freed right before the call), and compares the
# output and the gradients of sum(out * w) with the float32 reference (att.reference, the
# blockwise jax.lax attention that pk.attention runs for masks) within twice the error of a
# dense attention computed in the operands' dtype (scores and P rounded to it, as a kernel
# does), plus a small atol. Rows that no key is visible to must give exactly 0 (output and
# dq), keys that no row sees exactly 0 (dk, dv). The two calls must agree bit for bit except dq
# (summed by float32 reductions in any order).

def _gpu_case_masks(b, s, spec, rng):
    """(Masks, window, softcap, segment ids or None) of a mask spec."""
    q_seg = kv_seg = q_len = kv_len = None
    if "segments" in spec:
        q_seg = kv_seg = packed_ids(b, s, int(rng.integers(1 << 20)), mean=spec["segments"])
    if "apart" in spec:  # ids no key has: rows that see nothing
        q_seg = packed_ids(b, s, int(rng.integers(1 << 20)), mean=spec["apart"])
        kv_seg = np.where(q_seg % 3 == 2, q_seg + 1, q_seg).astype(np.int32)
    if "q_len" in spec:
        q_len = np.array(spec["q_len"][:b], np.int32)
    if "kv_len" in spec:
        kv_len = np.array(spec["kv_len"][:b], np.int32)
    j = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    masks = _attention.Masks(j(q_seg), j(kv_seg), j(q_len), j(kv_len))
    return masks, spec.get("window"), spec.get("softcap"), (q_seg, kv_seg)


def _dense_visible(b, s, causal, masks, window):
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    vis = np.ones((b, s, s), bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (j >= i - window[0]) & (j <= i + window[1])
    if masks.q_seg is not None:
        vis &= np.asarray(masks.q_seg)[:, :, None] == np.asarray(masks.k_seg)[:, None, :]
    if masks.q_len is not None:
        vis &= i[None] < np.asarray(masks.q_len)[:, None, None]
    if masks.kv_len is not None:
        vis &= j[None] < np.asarray(masks.kv_len)[:, None, None]
    return vis


def _dense_lowp(q, k, v, vis, scale, softcap):
    """Dense masked attention with the scores and P rounded to q's dtype (the yardstick of the
    error a kernel in that dtype makes); rows that see nothing give 0."""
    dt = q.dtype
    k, v = _attention.repeat_kv(q, k, v)
    x = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    x = x.astype(dt).astype(jnp.float32)
    if softcap is not None:
        x = softcap * jnp.tanh(x / softcap)
    m = jnp.asarray(vis)[:, None]
    x = jnp.where(m, x, -jnp.inf)
    mx = jnp.max(x, -1, keepdims=True)
    e = jnp.exp(x - jnp.where(jnp.isfinite(mx), mx, 0.0))
    den = e.sum(-1, keepdims=True)
    p = (e / jnp.where(den > 0, den, 1.0)).astype(dt)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, preferred_element_type=jnp.float32).astype(dt)


_GPU_MASKS = {  # every mask alone and the combinations training uses
    "segments": {"segments": 90},
    "segments+causal": {"segments": 90, "causal": True},
    "apart+causal": {"apart": 70, "causal": True},
    "window": {"window": (100, 37)},
    "window+causal": {"window": (127, 0), "causal": True},
    "softcap": {"softcap": 20.0},
    "softcap+causal": {"softcap": 5.0, "causal": True},
    "q_len": {"q_len": (300, 1, 77)},
    "kv_len": {"kv_len": (0, 250, 129)},
    "lengths+causal": {"q_len": (200, 333, 64), "kv_len": (190, 64, 333), "causal": True},
    "all": {"segments": 150, "window": (200, 3), "causal": True, "softcap": 30.0,
            "q_len": (310, 260, 100), "kv_len": (290, 333, 90)},
}
_GPU_SHAPES = [  # (B, S, H, Hkv, D)
    (2, 333, 4, 4, 64), (1, 1000, 8, 2, 128), (3, 77, 6, 3, 128), (2, 513, 8, 1, 64),
]
_GPU_CASES = [(shape, name) for shape in _GPU_SHAPES for name in _GPU_MASKS]


def _gpu_init():
    mesh = jax.make_mesh((1,), ("x",), devices=jax.devices("gpu")[:1])
    pk.init(mesh)
    assert pk.backend_name(att.NAME) == "cuda"


def _err(y, ref):
    return float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref.astype(jnp.float32))))


def _both(w, fn, *args):
    """fn(q, k, v) jitted, and the gradients of sum(fn(q, k, v) * w)."""
    loss = lambda a, b_, c: jnp.sum(fn(a, b_, c).astype(jnp.float32) * w)
    return jax.jit(lambda *x: (fn(*x), jax.grad(loss, argnums=(0, 1, 2))(*x)))(*args)


def _check_against(got, exact, lowp):
    """Output and gradients `got` within twice the dense low-precision yardstick's error of the
    float32 reference's, plus 2e-3 of its largest value plus 1e-3."""
    for qname, y, ref, lp in zip(("out", "dq", "dk", "dv"), [got[0], *got[1]],
                                 [exact[0], *exact[1]], [lowp[0], *lowp[1]]):
        err, err_lp = _err(y, ref), _err(lp, ref)
        atol = 2e-3 * float(jnp.max(jnp.abs(ref))) + 1e-3
        assert err <= 2 * err_lp + atol, (qname, err, err_lp, atol)


@functools.cache
def _gpu_inputs(shape, name, dtype):
    b, s, h, hkv, d = shape
    rng = np.random.default_rng(zlib.crc32(repr((shape, name)).encode()))
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 4)
    mk = lambda key, heads: jax.random.normal(key, (b, s, heads, d), jnp.float32).astype(dtype)
    spec = dict(_GPU_MASKS[name])
    for n in ("q_len", "kv_len"):  # lengths given for up to 3 batch rows
        if n in spec:
            spec[n] = tuple(min(x, s + 5) for x in spec[n]) + (s,) * 3
    masks, window, softcap, _ = _gpu_case_masks(b, s, spec, rng)
    w = jax.random.normal(keys[3], (b, s, h, d), jnp.float32)
    return (mk(keys[0], h), mk(keys[1], hkv), mk(keys[2], hkv), w, masks, window, softcap,
            bool(spec.get("causal", False)))


@pytest.mark.gpu
@pytest.mark.parametrize("shape,name", _GPU_CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-{c[1]}" for c in _GPU_CASES])
def test_gpu_masked_forward_and_grads(shape, name):
    _gpu_init()
    dtype = jnp.bfloat16
    q, k, v, w, masks, window, softcap, causal = _gpu_inputs(shape, name, dtype)
    b, s, _, d = q.shape
    scale = 1.0 / np.sqrt(d)
    vis = _dense_visible(b, s, causal, masks, window)

    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = lambda a, b_, c: att.reference(a, b_, c, causal=causal, scale=scale, window=window,
                                         softcap=softcap, masks=masks)
    exact = _both(w, ref, *f32)
    lowp = _both(w, lambda a, b_, c: _dense_lowp(a, b_, c, vis, scale, softcap), q, k, v)
    kernel = lambda a, b_, c: att._kernel_attention_masked(a, b_, c, masks, scale, causal,
                                                           window, softcap)
    runs = []
    for _ in range(2):
        for x in (q, k, v, q):
            poison(x.shape, dtype)
        runs.append(jax.block_until_ready(_both(w, kernel, q, k, v)))
    row_none = ~vis.any(2)  # [B, S]: rows that see no key
    key_none = ~vis.any(1)  # keys no row sees
    for out, grads in runs:
        ys = [out, *grads]
        refs = [exact[0], *exact[1]]
        yard = [lowp[0], *lowp[1]]
        for qname, y, ref, lp in zip(("out", "dq", "dk", "dv"), ys, refs, yard):
            assert y.dtype == dtype and not bool(jnp.any(jnp.isnan(y))), qname
            err, err_lp = _err(y, ref), _err(lp, ref)
            atol = 2e-3 * float(jnp.max(jnp.abs(ref))) + 1e-3
            assert err <= 2 * err_lp + atol, (qname, err, err_lp, atol)
        o, dq, dk, dv = (np.asarray(x, np.float32) for x in ys)
        assert not o[row_none].any() and not dq[row_none].any(), "rows that see no key"
        if key_none.any():
            assert not dk[key_none].any() and not dv[key_none].any(), "keys no row sees"
    (o0, g0), (o1, g1) = runs
    np.testing.assert_array_equal(np.asarray(o0, np.float32), np.asarray(o1, np.float32))
    for a, c in zip(g0[1:], g1[1:]):  # dk, dv
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(c, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_masked_fp16_and_mqa(d):
    """fp16 operands, MQA (one K/V head), every mask at once, S not a multiple of any tile."""
    _gpu_init()
    b, s, h = 2, 611, 4
    rng = np.random.default_rng(d)
    spec = {"segments": 120, "window": (300, 0), "causal": True, "softcap": 15.0,
            "q_len": (611, 500), "kv_len": (600, 611)}
    masks, window, softcap, _ = _gpu_case_masks(b, s, spec, rng)
    keys = jax.random.split(jax.random.key(d), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(jnp.float16)
    k, v = (jax.random.normal(kk, (b, s, 1, d), jnp.float32).astype(jnp.float16)
            for kk in keys[1:3])
    w = jax.random.normal(keys[3], q.shape, jnp.float32)
    scale = 0.7 / np.sqrt(d)
    vis = _dense_visible(b, s, True, masks, window)

    ref = lambda a, b_, c: att.reference(a, b_, c, causal=True, scale=scale, window=window,
                                         softcap=softcap, masks=masks)
    exact = _both(w, ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    lowp = _both(w, lambda a, b_, c: _dense_lowp(a, b_, c, vis, scale, softcap), q, k, v)
    kernel = lambda a, b_, c: att._kernel_attention_masked(a, b_, c, masks, scale, True, window,
                                                           softcap)
    got = _both(w, kernel, q, k, v)
    _check_against(got, exact, lowp)


@pytest.mark.gpu
def test_gpu_public_masked_attention_runs_the_masked_kernels():
    """pk.attention with the masks as a user passes them (segment ids, a causal window, a soft
    cap, lengths): the jitted program calls pk_attention forward and backward, and the output
    and gradients are within the yardstick above of the float32 reference."""
    _gpu_init()
    b, s, h, hkv, d = 2, 300, 4, 2, 64
    rng = np.random.default_rng(5)
    spec = {"segments": 60, "window": (90, 0), "causal": True, "softcap": 20.0,
            "q_len": (300, 250), "kv_len": (280, 300)}
    masks, window, softcap, (ids, _) = _gpu_case_masks(b, s, spec, rng)
    keys = jax.random.split(jax.random.key(9), 4)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
            for kk in keys[1:3])
    w = jax.random.normal(keys[3], q.shape, jnp.float32)
    scale = 1.0 / np.sqrt(d)
    vis = _dense_visible(b, s, True, masks, window)
    user = {"causal": True, "segment_ids": jnp.asarray(ids), "local_window_size": window,
            "logits_soft_cap": softcap, "query_seq_lengths": masks.q_len,
            "key_value_seq_lengths": masks.kv_len}

    public = lambda a, b_, c: pk.attention(a, b_, c, **user)
    lowered = jax.jit(jax.grad(lambda *x: jnp.sum(public(*x).astype(jnp.float32)),
                               argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert lowered.count("custom_call @pk_attention") == 2, lowered.count("@pk_attention")
    ref = lambda a, b_, c: att.reference(a, b_, c, causal=True, scale=scale, window=window,
                                         softcap=softcap, masks=masks)
    exact = _both(w, ref, *(x.astype(jnp.float32) for x in (q, k, v)))
    lowp = _both(w, lambda a, b_, c: _dense_lowp(a, b_, c, vis, scale, softcap), q, k, v)
    got = _both(w, public, q, k, v)
    _check_against(got, exact, lowp)


@pytest.mark.gpu
def test_gpu_masked_tiles_are_skipped():
    """A causal window of 128 keys costs O(S W): from S = 16K to 64K its time grows about 4x
    (linear), well under the 16x a kernel that computed masked tiles would take, and at 16K it
    is well under the unmasked causal kernel's. Documents of 1K packed into 16K likewise take
    well under the causal kernel's. (The bounds leave room for each CTA's fixed cost: on the
    H100 the window took 0.16x of causal at 16K, not the 1/64 that counting tiles gives.)"""
    import time

    _gpu_init()
    h, d = 8, 128

    def inputs(s):
        keys = jax.random.split(jax.random.key(s), 3)
        return tuple(jax.random.normal(kk, (1, s, h, d), jnp.float32).astype(jnp.bfloat16)
                     for kk in keys)

    def timed(fn, args):
        f = jax.jit(fn)
        jax.block_until_ready(f(*args))
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(5):
                out = f(*args)
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - start) / 5)
        return best

    def window_fn(a, b_, c):
        return att._kernel_attention_masked(a, b_, c, None, 1 / np.sqrt(d), True, (127, 0))

    short, long_ = inputs(16384), inputs(65536)
    ids = jnp.asarray(np.repeat(np.arange(16), 1024)[None], jnp.int32)
    full = timed(lambda a, b_, c: pk.attention(a, b_, c, causal=True), short)
    window = timed(window_fn, short)
    window_long = timed(window_fn, long_)
    docs = timed(lambda a, b_, c: att._kernel_attention_masked(
        a, b_, c, _attention.Masks(ids, ids, None, None), 1 / np.sqrt(d), True), short)
    assert window_long < 8 * window, (window_long, window)
    assert window < 0.25 * full, (window, full)
    assert docs < 0.25 * full, (docs, full)

