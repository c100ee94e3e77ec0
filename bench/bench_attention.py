"""pk.attention against the attention a JAX user would pick instead, on one GPU, in one process:
FlashAttention-3 (`flash-attn3-jax`, an XLA FFI binding of FA3), cuDNN
(`jax.nn.dot_product_attention(..., implementation="cudnn")`) and tokamax's Mosaic GPU kernels
(`tokamax.dot_product_attention(..., implementation="mosaic")`); forward and forward+backward.

Grid (`--grid fa3`, the default; rows tagged `"grid": "fa3-paper"`): the FlashAttention-3
paper's, 16K tokens and hidden 2048: S in 512 .. 16K with B = 16384 / S, D in 64 and 128 with
H = 2048 / D; plus GQA 32/4 (B 1, S 16K, H 32, Hkv 4, D 128) and S = 32K (B 1, H 16, D 128):
14 shapes, each causal and not, 28 cases. `--quick` takes 4 of the shapes (8 cases),
`--grid legacy` the earlier 8 shapes of this script.

For each shape, first a correctness check of every implementation: its forward output, and
with the backward its dq, dk and dv, on the first K/V head group (the query heads that share K/V
head 0, every batch) against a float32 reference (pk_jax's blockwise attention); an error within
twice the same-dtype yardstick plus 2e-3 of the reference's largest value plus 1e-3 passes. The
yardstick is the lower median of the other implementations' errors, raised to cuDNN's error
where cuDNN passed (quantity by quantity), so a kernel fails only when it is well off where the
others agree. A peer that is missing, refuses the shape or fails the check is
reported on one line and left out at that shape; pk.attention failing it leaves the shape out
and makes the run exit 1 at the end.

Then the timing: batches of back-to-back jitted calls rotating over 3 input sets, the
implementations' batches interleaved (rep 1 of each, then rep 2, ...), median per call. TFLOP/s
count 4 B S^2 H D for the forward (half when causal) and 3.5 times that for forward+backward.
One line per shape and pass ending in "x vs FA3, x vs cuDNN, x vs tokamax" (peer time / ours);
at the end the geometric mean and the minimum per pass and peer, with the issue 38 goals marked
(against FA3 and cuDNN: geomean >= 1.0x, no shape below 0.9x). Rows go to
bench/results/attention.jsonl, one per (shape, pass, peer): `baseline` "fa3" | "cudnn" |
"tokamax" (| "xla"), `pass` "forward" | "forward+backward", `ratio` = peer time / ours, `tflops`
ours and `baseline_tflops` the peer's, `grid`. bench/plot_attention.py draws
bench/results/attention.png from the newest fa3-paper rows when matplotlib is there.

The peers come from wheels carried to the GPU machine (it has no network); fetch them where
there is network, from the repository root:

    W=.peers/wheels; pip download --no-deps --only-binary=:all: --python-version 3.12 \\
      --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d $W \\
      flash-attn3-jax==0.2.3 einops tokamax==0.0.17 absl-py einshape jaxtyping wadler_lindig \\
      pydantic pydantic-core annotated-types typing-inspection typing_extensions qwix \\
      immutabledict tensorboardx protobuf packaging tqdm flax==0.12.10 optax msgpack rich \\
      markdown-it-py mdurl pygments treescope pyyaml etils

carry `.peers`, and on the GPU machine (also from the repository root):

    bash bench/peers_install.sh /tmp/peers && \\
      PYTHONPATH=$PWD:/tmp/peers python3 bench/bench_attention.py [--quick] [--no-bwd]

xprof, which tokamax imports at import time for its own profiler-based benchmarking, is not
carried: bench/peers_stub/xprof stands in for it when it is absent. `--smoke` runs the script's
own paths on tiny shapes on any machine (the reference allowed; rows go to --out only).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import common
import jax
import jax.numpy as jnp

import pk_jax as pk
from pk_jax.ops import attention as att

HERE = pathlib.Path(__file__).resolve().parent
STUB = HERE / "peers_stub"
LABELS = {"pk": "pk", "fa3": "FA3", "cudnn": "cuDNN", "tokamax": "tokamax", "xla": "XLA"}
DEFAULT_PEERS = "fa3,cudnn,tokamax"
GOALS = {"fa3": (1.0, 0.9), "cudnn": (1.0, 0.9)}  # issue 38: geomean at least, no shape below
PASSES = (("forward", 1.0), ("forward+backward", 3.5))  # FLOPs relative to the forward's
QUANTITIES = ("fwd", "out", "dq", "dk", "dv")  # fwd: the forward-only call's output
SAME_DTYPE = "reference"  # the blockwise reference in q's dtype, a yardstick of last resort
XLA_LIMIT = 8 << 30  # bytes of float32 scores the XLA peer may materialise
TOKENS, HIDDEN = 16384, 2048  # the FA3 paper's grid


def fa3_grid() -> list[tuple]:
    """(subset, B, S, H, Hkv, D) of the FA3 paper's grid, GQA 32/4 and S = 32K."""
    paper = [("paper", TOKENS // s, s, HIDDEN // d, HIDDEN // d, d)
             for d in (64, 128) for s in (512, 1024, 2048, 4096, 8192, 16384)]
    return paper + [("gqa", 1, 16384, 32, 4, 128), ("long", 1, 32768, 16, 16, 128)]


GRIDS = {
    "fa3": ("fa3-paper", fa3_grid()),
    "legacy": ("legacy", [("legacy",) + s for s in [  # (B, S, H, Hkv, D)
        (1, 4096, 32, 32, 128), (1, 8192, 16, 16, 128), (1, 16384, 16, 16, 128),
        (1, 32768, 16, 16, 128), (1, 8192, 32, 32, 64), (1, 32768, 16, 16, 64),
        (1, 16384, 32, 4, 128), (1, 32768, 32, 4, 64)]]),
    "smoke": ("smoke", [("smoke", 2, 256, 4, 2, 64), ("smoke", 1, 384, 2, 2, 128)]),
}
QUICK = {"fa3": [("paper", 16, 1024, 32, 32, 64), ("paper", 4, 4096, 16, 16, 128),
                 ("gqa", 1, 16384, 32, 4, 128), ("long", 1, 32768, 16, 16, 128)],
         "legacy": [("legacy", 1, 4096, 32, 32, 128), ("legacy", 1, 8192, 16, 16, 128),
                    ("legacy", 1, 8192, 32, 32, 64), ("legacy", 1, 16384, 32, 4, 128)]}


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


# ------------------------------------------------------------------------------ the peers


class Peer:
    """One implementation: `make(causal)` gives fn(q, k, v) -> out, [B, S, H, D] layout;
    `refuses(b, s, h, hkv, d)` a reason it is not run at a shape, or None."""

    def __init__(self, name: str, version: str, make: Callable,
                 refuses: Callable = lambda *shape: None):
        self.name, self.version, self.make, self.refuses = name, version, make, refuses


def _load_fa3() -> Peer:
    import flash_attn3_jax  # flash-attn3-jax: XLA FFI targets registered at import

    def make(causal):
        return lambda q, k, v: flash_attn3_jax.flash_mha(q, k, v, is_causal=causal)
    return Peer("fa3", f"flash-attn3-jax {importlib.metadata.version('flash-attn3-jax')}", make)


def _load_cudnn() -> Peer:
    def make(causal):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="cudnn")
    version = f"jax {jax.__version__}"
    try:  # private, so only for the record
        from jax._src.lib import cuda_versions
        version += f", cuDNN {cuda_versions.cudnn_get_version()}"
    except Exception as e:  # noqa: BLE001
        version += f" (cuDNN version unknown: {type(e).__name__})"
    return Peer("cudnn", version, make)


def _load_tokamax() -> Peer:
    stub = importlib.util.find_spec("xprof") is None
    if stub and str(STUB) not in sys.path:
        sys.path.append(str(STUB))  # appended: a real xprof found later still wins
    import tokamax

    def make(causal):
        return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                                             implementation="mosaic")
    return Peer("tokamax", f"tokamax {tokamax.__version__}" + (" (xprof stand-in)" if stub
                                                                else ""), make)


def _load_xla() -> Peer:
    def make(causal):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="xla")

    def refuses(b, s, h, hkv, d):
        return (f"its float32 scores would take {b * h * s * s * 4 / 2**30:.0f} GiB"
                if b * h * s * s * 4 > XLA_LIMIT else None)
    return Peer("xla", f"jax {jax.__version__}", make, refuses)


LOADERS = {"fa3": _load_fa3, "cudnn": _load_cudnn, "tokamax": _load_tokamax, "xla": _load_xla}


def load_peers(names: list[str]) -> dict[str, Peer]:
    """The peers that import, one line for each that does not."""
    peers = {}
    for name in names:
        try:
            peers[name] = LOADERS[name]()
            print(f"peer {LABELS[name]}: {peers[name].version}")
        except Exception as e:  # noqa: BLE001 - any failure leaves the peer out, never the run
            hint = (" (install the carried wheels: bash bench/peers_install.sh DIR, then put DIR "
                    "on PYTHONPATH)" if isinstance(e, ImportError) else "")
            print(f"peer {LABELS[name]}: not available, left out ({_line(e)}){hint}")
    return peers


# ---------------------------------------------------------------------- check and timing


def _inputs(b, s, h, hkv, d, dtype, sets=3):
    out = []
    for i in range(sets):
        kq, kk, kv, kd = jax.random.split(jax.random.key(1000 * i + s + h + d), 4)
        mk = lambda key, heads: jax.random.normal(key, (b, s, heads, d), jnp.float32).astype(dtype)
        out.append((mk(kq, h), mk(kk, hkv), mk(kv, hkv), mk(kd, h)))
    return jax.block_until_ready(out)


def _vjp(fn):
    def f(q, k, v, do):
        out, pull = jax.vjp(fn, q, k, v)
        return out, pull(do)
    return jax.jit(f)


def _group(g: int, o=None, dq=None, dk=None, dv=None) -> dict:
    """The first K/V head group of the results: query heads 0..g-1, K/V head 0."""
    got = {"out": o, "dq": dq, "dk": dk, "dv": dv}
    return {n: x[:, :, :(1 if n in ("dk", "dv") else g)] for n, x in got.items() if x is not None}


def check(fns: dict, causal: bool, inputs: tuple, bwd: bool) -> tuple[dict, dict]:
    """Runs every implementation on `inputs` (fns: name -> (forward jit, vjp jit)) and compares
    its first K/V head group with the float32 reference. Returns (name -> quantity -> max
    error, plus "scale" and, where fewer than two implementations ran, SAME_DTYPE: the
    reference's own error in q's dtype; name -> reason, for the implementations that raised)."""
    q, k, v, do = inputs
    g = q.shape[2] // k.shape[2]
    sl = [x[:, :, :n] for x, n in zip(inputs, (g, 1, 1, g))]
    f32 = [x.astype(jnp.float32) for x in sl]
    ref = lambda a, b, c: att.reference(a, b, c, causal=causal, scale=1 / math.sqrt(q.shape[-1]))
    if bwd:
        want_o, (want_dq, want_dk, want_dv) = _vjp(ref)(*f32)
        want = {"out": want_o, "dq": want_dq, "dk": want_dk, "dv": want_dv}
    else:
        want = {"out": jax.jit(ref)(*f32[:3])}
    want["fwd"] = want["out"]
    errs, failed = {}, {}
    for name, (fwd, vjp) in fns.items():
        try:
            got = {"fwd": fwd(q, k, v)[:, :, :g]}
            if bwd:
                o, (dq, dk, dv) = vjp(q, k, v, do)
                got.update(_group(g, o, dq, dk, dv))
            errs[name] = {n: float(jnp.max(jnp.abs(x.astype(jnp.float32) - want[n])))
                          for n, x in got.items()}
            del got
        except Exception as e:  # noqa: BLE001 - a peer that refuses the shape is left out
            failed[name] = _line(e)
    if len(errs) < 2:  # nothing to compare with: the reference itself in q's dtype
        if bwd:
            o, (dq, dk, dv) = _vjp(ref)(*sl)
            got = {"out": o, "dq": dq, "dk": dk, "dv": dv}
        else:
            got = {"out": jax.jit(ref)(*sl[:3])}
        got["fwd"] = got["out"]
        errs[SAME_DTYPE] = {n: float(jnp.max(jnp.abs(x.astype(jnp.float32) - want[n])))
                            for n, x in got.items()}
    errs["scale"] = {n: float(jnp.max(jnp.abs(w))) for n, w in want.items()}
    return errs, failed


# The quantities each pass is judged on: the forward's output alone; the output and the
# gradients of the vjp.
PASS_QUANTITIES = {"forward": ("fwd",), "forward+backward": ("out", "dq", "dk", "dv")}


def _quantities(errs: dict, keep: tuple) -> dict:
    """errs restricted to the quantities in `keep`."""
    return {n: {q: e for q, e in d.items() if q in keep} for n, d in errs.items()}


def judge(errs: dict) -> dict[str, tuple[float, str]]:
    """name -> (largest error / tolerance over the quantities, the quantity), for every
    implementation in errs (besides "scale"). Tolerance: 2 * yardstick + 2e-3 * scale + 1e-3;
    the yardstick is the lower median of the other implementations' errors, raised to cuDNN's
    error where cuDNN passed its own check (so the tolerance is never below the one this
    benchmark used before the peers came, and one wrong peer cannot loosen it)."""
    scale = errs["scale"]
    names = [n for n in errs if n != "scale"]

    def worst(name, extra):
        out = (0.0, "")
        for qty, err in errs[name].items():
            others = [errs[o][qty] for o in names if o != name and qty in errs[o]]
            yard = statistics.median_low(others) if others else 0.0
            if extra and qty in errs[extra]:
                yard = max(yard, errs[extra][qty])
            tol = 2 * yard + 2e-3 * scale[qty] + 1e-3
            out = max(out, (err / tol if math.isfinite(err) else math.inf, qty))
        return out

    verdict = {}
    if "cudnn" in names:
        verdict["cudnn"] = worst("cudnn", None)
    trusted = "cudnn" if verdict.get("cudnn", (math.inf,))[0] <= 1 else None
    for name in names:
        if name != "cudnn":
            verdict[name] = worst(name, trusted)
    return {n: verdict[n] for n in names}


def _iters(seconds_per_call: float) -> int:
    return max(2, min(100, int(0.05 / seconds_per_call)))


def time_all(fns: dict, arg_sets, iters: int, reps: int) -> tuple[dict, dict]:
    """name -> (median us per call, median us to issue one), interleaved; an implementation
    that fails here is left out (name -> reason) and the rest timed again."""
    failed = {}
    fns = dict(fns)
    while fns:
        try:
            return common.time_us_interleaved(fns, arg_sets, iters=iters, reps=reps), failed
        except Exception:  # noqa: BLE001 - find who failed, leave it out, time the rest
            for name, fn in list(fns.items()):
                try:
                    jax.block_until_ready(fn(*arg_sets[0]))
                except Exception as e:  # noqa: BLE001
                    failed[name] = _line(e)
                    del fns[name]
            if not failed:  # none fails alone: leave the pass out at this shape
                return {}, dict.fromkeys(fns, "the interleaved timing failed")
    return {}, failed


# --------------------------------------------------------------------------------- the run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=("fa3", "legacy"), default="fa3",
                    help="fa3: the FA3 paper's grid + GQA 32/4 + S=32K (default); legacy: the "
                         "earlier 8 shapes")
    ap.add_argument("--peers", default=DEFAULT_PEERS,
                    help=f"comma-separated, of fa3, cudnn, tokamax, xla (default {DEFAULT_PEERS}"
                         "); empty for none")
    ap.add_argument("--quick", action="store_true", help="four shapes, fewer repetitions")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=None,
                    help="interleaved batches per implementation (default 7, 5 with --quick)")
    ap.add_argument("--budget-s", type=float, default=330.0,
                    help="seconds the run aims to stay within: fewer reps (down to 3) for the "
                         "remaining shapes when the pace says it would not (default 330)")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="rows file (default bench/results/attention.jsonl)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes, the reference allowed: tests this script on any machine; "
                         "needs --out")
    args = ap.parse_args()
    dtype = jnp.dtype(args.dtype)
    names = [p.strip() for p in args.peers.split(",") if p.strip()]
    unknown = [p for p in names if p not in LOADERS]
    if unknown:
        ap.error(f"unknown peers {unknown}; choose from {sorted(LOADERS)}")
    if args.smoke and args.out is None:
        ap.error("--smoke writes rows to --out only")
    if not args.smoke and pk.backend_name(att.NAME) != "cuda":
        raise SystemExit("pk.attention would run its reference here: no sm_90 GPU or no "
                         "extension")
    grid_tag, shapes = GRIDS["smoke" if args.smoke else args.grid]
    if args.quick and not args.smoke:
        shapes = QUICK[args.grid]
    reps = args.reps or (5 if args.quick or args.smoke else 7)
    passes = PASSES[:1] if args.no_bwd else PASSES
    bwd = not args.no_bwd
    t0 = time.perf_counter()
    peers = load_peers(names)
    t_cases = time.perf_counter()
    cases = [(sh, causal) for sh in shapes for causal in (False, True)]
    print(f"{len(cases)} cases ({len(shapes)} shapes, causal and not), {dtype.name}, passes: "
          f"{', '.join(p for p, _ in passes)}; {reps} interleaved batches of ~50 ms per "
          f"implementation and pass; device {jax.devices()[0].device_kind}", flush=True)

    ratios: dict[tuple[str, str], list[tuple[float, str]]] = {}
    tflops: dict[tuple[str, str], list[float]] = {}
    wrong = []

    def run_case(subset, b, s, h, hkv, d, causal, reps):
        """Checks and times one case; rows and ratios recorded as it goes."""
        t_case = time.perf_counter()
        name = f"{b}x{s}x{h}/{hkv}x{d}" + (" causal" if causal else "")
        shape = {"b": b, "s": s, "h": h, "hkv": hkv, "d": d, "causal": causal}
        sets = _inputs(b, s, h, hkv, d, dtype)
        makers = {"pk": lambda q, k, v, c=causal: pk.attention(q, k, v, causal=c)}
        for p in peers.values():
            why = p.refuses(b, s, h, hkv, d)
            if why:
                print(f"  {name}: {LABELS[p.name]} left out ({why})")
            else:
                makers[p.name] = p.make(causal)
        fns = {n: (jax.jit(f), _vjp(f)) for n, f in makers.items()}
        errs, failed = check(fns, causal, sets[0], bwd)
        # Each pass is judged on its own quantities: a peer whose backward is wrong still has
        # its forward timed (and the reverse).
        left_out = {}
        verdict = {}
        for pass_name, _ in passes:
            v = judge(_quantities(errs, PASS_QUANTITIES[pass_name]))
            v.pop(SAME_DTYPE, None)
            left_out[pass_name] = dict(failed)
            for n, (r, qty) in v.items():
                verdict[n] = max(verdict.get(n, (0.0, "")), (r, qty))
                if r > 1:
                    left_out[pass_name][n] = (
                        f"{qty} error {errs[n][qty]:.3g} over the tolerance (x{r:.2f}; "
                        f"largest reference value {errs['scale'][qty]:.3g})")
        for pass_name, _ in passes:
            for n, why in left_out[pass_name].items():
                print(f"  {name}: {LABELS[n]} {'WRONG' if n in verdict else 'failed'} "
                      f"({pass_name}), left out of that pass at this shape: {why}", flush=True)
        print(f"  {name}: checked against float32, largest error / tolerance: "
              + ", ".join(f"{LABELS[n]} {r:.2f}" for n, (r, _) in verdict.items())
              + (f" (yardstick: the reference in {dtype.name})" if SAME_DTYPE in errs else ""),
              flush=True)
        if any("pk" in lo for lo in left_out.values()):
            wrong.append(name)
            return
        flop = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
        for pass_name, mult in passes:
            work = flop * mult
            which = 0 if pass_name == "forward" else 1
            arg_sets = [x[:3] for x in sets] if which == 0 else sets
            alive = [n for n in makers if n not in left_out[pass_name]]
            times, tfail = time_all({n: fns[n][which] for n in alive}, arg_sets,
                                    _iters(work / 500e12), reps)
            for n, why in tfail.items():
                print(f"  {name}: {LABELS[n]} failed while timed ({pass_name}), left out: {why}")
            if "pk" not in times:
                wrong.append(f"{name} ({pass_name}: pk.attention failed while timed)")
                continue
            tf = {n: work / t / 1e6 for n, (t, _) in times.items()}
            t_o, issue_o = times["pk"]
            vs = []
            for n in (p for p in names if p in makers):
                if n not in times:
                    vs.append(f"{LABELS[n]} -")
                    continue
                t_b, issue_b = times[n]
                row = common.record(
                    op="attention", shape=shape, dtype=dtype.name, world=1, processes=1,
                    median_us=t_o, tflops=tf["pk"], baseline=n, baseline_median_us=t_b,
                    baseline_tflops=round(tf[n], 2), path=args.out,
                    **{"pass": pass_name}, grid=grid_tag, subset=subset,
                    baseline_version=peers[n].version, issue_us=round(issue_o, 3),
                    baseline_issue_us=round(issue_b, 3),
                    max_err=errs["pk"], baseline_max_err=errs[n], reps=reps,
                    iters=_iters(work / 500e12), quick=args.quick)
                ratios.setdefault((pass_name, n), []).append((row["ratio"], name))
                tflops.setdefault((pass_name, n), []).append(tf[n])
                vs.append(f"{row['ratio']:.2f}x vs {LABELS[n]}")
            tflops.setdefault((pass_name, "pk"), []).append(tf["pk"])
            cols = " ".join(f"{LABELS[n]} {tf[n]:6.1f}" if n in tf else f"{LABELS[n]} {'-':>6}"
                            for n in ["pk"] + [p for p in names if p in makers])
            print(f"{name:>26} {pass_name:>16}  TF/s: {cols}  " + ", ".join(vs), flush=True)
        print(f"  ({time.perf_counter() - t_case:.1f} s)", flush=True)

    for i, ((subset, b, s, h, hkv, d), causal) in enumerate(cases):
        if i >= min(4, len(cases) // 2):
            elapsed = time.perf_counter() - t_cases
            if elapsed / i * len(cases) > args.budget_s and reps > 3:
                reps = max(3, reps - 2)
                print(f"  (pace: {elapsed:.0f} s for {i} of {len(cases)} cases; {reps} reps "
                      f"from here on)", flush=True)
        try:
            run_case(subset, b, s, h, hkv, d, causal, reps)
        except Exception as e:  # noqa: BLE001 - one case's failure is reported, the run goes on
            print(f"  {b}x{s}x{h}/{hkv}x{d}{' causal' if causal else ''}: the case failed: "
                  f"{_line(e)}", flush=True)
            wrong.append(f"{b}x{s}x{h}/{hkv}x{d}{' causal' if causal else ''} (case failed)")
        jax.clear_caches()  # this case's executables and inputs are not needed again

    summarize(ratios, tflops, passes, names, wrong, time.perf_counter() - t0)
    if not args.smoke:
        try:
            import plot_attention
            plot_attention.main()
        except Exception as e:  # noqa: BLE001 - no matplotlib, or no rows: the rows stand
            print(f"no plot: {_line(e)}")
    return 1 if wrong else 0


def summarize(ratios, tflops, passes, names, wrong, seconds) -> None:
    print(f"\nsummary ({seconds:.0f} s in all; ratio = peer time / pk.attention time, above 1 "
          "is pk.attention faster):")
    for pass_name, _ in passes:
        if tflops.get((pass_name, "pk")):
            t = tflops[(pass_name, "pk")]
            print(f"{pass_name}: pk.attention {min(t):.0f}-{max(t):.0f} TF/s")
        for n in names:
            got = ratios.get((pass_name, n))
            if not got:
                print(f"  vs {LABELS[n]}: not measured")
                continue
            gm = common.geomean([r for r, _ in got])
            low, where = min(got)
            t = tflops[(pass_name, n)]
            line = (f"  vs {LABELS[n]} ({min(t):.0f}-{max(t):.0f} TF/s): geomean {gm:.3f}x over "
                    f"{len(got)} shapes, min {low:.3f}x ({where})")
            if n in GOALS:
                goal, floor = GOALS[n]
                below = sum(r < floor for r, _ in got)
                line += (f"; goal geomean >= {goal}: {'met' if gm >= goal else 'missed'}, "
                         f"no shape below {floor}: "
                         + ("met" if not below else f"missed ({below} below)"))
            print(line)
    for w in wrong:
        print(f"pk.attention WRONG or failed: {w}")


if __name__ == "__main__":
    sys.exit(main())
