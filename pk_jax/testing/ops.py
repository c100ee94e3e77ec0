"""pk_jax's cross-rank ops in the rank emulator: the launcher fields of one call, its inputs on
the device, its outputs poisoned before the call, and the numpy reference it must equal.

A `Case` is the host side of one call (per-rank numpy inputs, the launcher's parameters, the
expected per-rank outputs); `Call` puts it on a `World`'s device, queues it and checks it.
The parameters mirror what the ops' Python lowerings pass to their FFI handlers
(pk_jax/ops/*.py), so a case runs the launcher exactly as XLA would for the same shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pk_jax.testing.emulator import DTYPES, DeviceBuffer, World, np_dtype

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
GEMMS = ("gemm_rs", "ag_gemm", "gemm_ar")
OPS = COLLECTIVES + GEMMS
TILE_128x128, TILE_128x256 = 1, 2


@dataclass
class Case:
    """One call of `op` on every rank: inputs[r] and expected[r] map buffer names to arrays."""

    op: str
    dtype: str
    inputs: list[dict[str, np.ndarray]]
    expected: list[dict[str, np.ndarray]]
    params: dict = field(default_factory=dict)
    exact: bool = True
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def world(self) -> int:
        return len(self.inputs)


def _cast(a: np.ndarray, dtype: str) -> np.ndarray:
    return np.asarray(a, np.float64).astype(np.float32).astype(np_dtype(dtype))


def integers(rng: np.random.Generator, shape, lo: int = -3, hi: int = 4) -> np.ndarray:
    return rng.integers(lo, hi, size=shape).astype(np.float64)


# ---------------------------------------------------------------------------------------------
# Collectives (flattened views; the runs are what the ops' lowerings pass)

def all_reduce(xs: list[np.ndarray], dtype: str, *, algo: int = 0, exact: bool = True) -> Case:
    """y = sum over ranks (fp32 in the kernel: exact for integers in the type's range)."""
    total = np.sum([np.asarray(x, np.float64) for x in xs], axis=0)
    y = _cast(total, dtype)
    return Case("all_reduce", dtype, [{"x": _cast(x, dtype)} for x in xs],
                [{"y": y} for _ in xs], {"p0": algo}, exact, 1e-2, 1e-2)


def all_gather(xs: list[np.ndarray], dtype: str) -> Case:
    """y = the ranks' x back to back (axis 0)."""
    xs = [x.astype(np_dtype(dtype)) if dtype == "int32" else _cast(x, dtype) for x in xs]
    y = np.concatenate([x.reshape(-1) for x in xs])
    return Case("all_gather", dtype, [{"x": x} for x in xs], [{"y": y} for _ in xs],
                {"p0": max(1, xs[0].size)})


def reduce_scatter(xs: list[np.ndarray], dtype: str, *, exact: bool = True) -> Case:
    """y_r = slice r (axis 0, n / P elements) of the sum over ranks."""
    p = len(xs)
    total = np.sum([np.asarray(x, np.float64).reshape(-1) for x in xs], axis=0)
    n = total.size
    ys = [_cast(total[r * n // p:(r + 1) * n // p], dtype) for r in range(p)]
    return Case("reduce_scatter", dtype, [{"x": _cast(x, dtype)} for x in xs],
                [{"y": y} for y in ys], {"p0": max(1, n // p)}, exact, 1e-2, 1e-2)


def all_to_all(xs: list[np.ndarray], dtype: str, split_axis: int, concat_axis: int) -> Case:
    """lax.all_to_all(x, split_axis, concat_axis, tiled=True) of every rank."""
    p = len(xs)
    xs = [x.astype(np_dtype(dtype)) if dtype == "int32" else _cast(x, dtype) for x in xs]
    ys = [np.concatenate([np.split(x, p, axis=split_axis)[r] for x in xs], axis=concat_axis)
          for r in range(p)]
    block = list(xs[0].shape)
    block[split_axis] //= p
    split_run = max(1, int(np.prod(block[split_axis:])))
    concat_run = max(1, int(np.prod(block[concat_axis:])))
    return Case("all_to_all", dtype, [{"x": x} for x in xs], [{"y": y} for y in ys],
                {"p0": split_run, "p1": concat_run})


# ---------------------------------------------------------------------------------------------
# Fused tensor-parallel GEMMs

def _gemm_params(m: int, n: int, config: int | None) -> dict:
    if config is None:
        config = TILE_128x256 if m * n >= 4096 * 4096 else TILE_128x128
    return {"config": config, "group_m": 8}


def gemm_rs(xs, ws, dtype: str, *, config: int | None = None, exact: bool = True) -> Case:
    """y_r = rows [r M/P, (r+1) M/P) of sum_p x_p @ w_p (x_p [M, K], w_p [K, N])."""
    p = len(xs)
    total = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64) for x, w in zip(xs, ws))
    m, n = total.shape
    ys = [_cast(total[r * m // p:(r + 1) * m // p], dtype) for r in range(p)]
    return Case("gemm_rs", dtype,
                [{"x": _cast(x, dtype), "w": _cast(w, dtype)} for x, w in zip(xs, ws)],
                [{"y": y} for y in ys], _gemm_params(m, n, config), exact, 2e-2, 2e-2)


def gemm_ar(xs, ws, dtype: str, *, config: int | None = None, exact: bool = True) -> Case:
    """y = sum_p x_p @ w_p on every rank."""
    total = sum(np.asarray(x, np.float64) @ np.asarray(w, np.float64) for x, w in zip(xs, ws))
    y = _cast(total, dtype)
    return Case("gemm_ar", dtype,
                [{"x": _cast(x, dtype), "w": _cast(w, dtype)} for x, w in zip(xs, ws)],
                [{"y": y} for _ in xs], _gemm_params(*total.shape, config), exact, 2e-2, 2e-2)


def ag_gemm(xs, ws, dtype: str, *, num_comm_sms: int = 2, config: int | None = None,
            exact: bool = True) -> Case:
    """y_r = concat_p(x_p) @ w_r and x_full = concat_p(x_p) (x_p [Mp, K], w_r [K, N])."""
    xs = [_cast(x, dtype) for x in xs]
    full = np.concatenate(xs)
    ys = [_cast(full.astype(np.float64) @ np.asarray(w, np.float64), dtype) for w in ws]
    params = _gemm_params(full.shape[0], ys[0].shape[1], config)
    params["num_comm_sms"] = num_comm_sms
    return Case("ag_gemm", dtype, [{"x": x, "w": _cast(w, dtype)} for x, w in zip(xs, ws)],
                [{"y": y, "x_full": full} for y in ys], params, exact, 2e-2, 2e-2)


# ---------------------------------------------------------------------------------------------

class Call:
    """A Case on a World's device: inputs copied in, outputs poisoned, ready to queue."""

    def __init__(self, world: World, case: Case, *, poison: int = 0xFF):
        if case.world != world.world:
            raise ValueError(f"Call: a case for P={case.world} on a world of {world.world}.")
        self.world, self.case = world, case
        self.buffers: list[dict[str, DeviceBuffer]] = []
        self.args: list[dict] = []
        for r in range(world.world):
            bufs = {k: DeviceBuffer.from_array(v) for k, v in case.inputs[r].items()}
            for k, v in case.expected[r].items():
                bufs[k] = DeviceBuffer(v.nbytes)
                bufs[k].fill(poison)
            self.buffers.append(bufs)
            self.args.append(self._fields(r, bufs))

    def _fields(self, r: int, bufs: dict[str, DeviceBuffer]) -> dict:
        c = self.case
        fields = {"dtype": DTYPES[c.dtype], **c.params}
        fields.update({k: b for k, b in bufs.items()})
        x = c.inputs[r]["x"]
        if c.op in COLLECTIVES:
            fields["n"] = x.size
            fields["n_out"] = c.expected[r]["y"].size
        else:
            y = c.expected[r]["y"]
            fields.update(m=x.shape[0], k=x.shape[1], n=c.inputs[r]["w"].shape[1],
                          y_rows=y.shape[0], y_cols=y.shape[1])
        return fields

    def launch(self, *, delays_ns: list[int] | None = None, skip: tuple[int, ...] = ()) -> None:
        self.world.call(self.case.op, self.args, delays_ns=delays_ns, skip=skip)

    def outputs(self, rank: int) -> dict[str, np.ndarray]:
        return {k: self.buffers[rank][k].read(v.dtype, v.shape)
                for k, v in self.case.expected[rank].items()}

    def check(self, ranks=None) -> list[str]:
        """Mismatches of every rank's outputs against the case (empty when all match)."""
        c = self.case
        problems = []
        for r in (range(c.world) if ranks is None else ranks):
            for k, got in self.outputs(r).items():
                want = c.expected[r][k]
                if c.exact:  # by value (-0 == 0; the NaN poison never equals)
                    ok = np.array_equal(got.astype(np.float64), want.astype(np.float64))
                else:
                    g, w = got.astype(np.float64), want.astype(np.float64)
                    ok = bool(np.all(np.isfinite(g))) and np.allclose(g, w, c.atol, c.rtol)
                if not ok:
                    g, w = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
                    bad = np.flatnonzero(~np.isclose(g, w, c.rtol, c.atol) | ~np.isfinite(g))
                    i = int(bad[0]) if bad.size else 0
                    problems.append(f"{c.op} rank {r} {k}{list(want.shape)}: {bad.size} "
                                    f"elements differ, first at {i}: got {g[i]} want {w[i]}")
        return problems

    def free(self) -> None:
        for bufs in self.buffers:
            for b in bufs.values():
                b.free()
        self.buffers = []
