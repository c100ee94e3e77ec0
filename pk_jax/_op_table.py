"""The op table (ffi/op_table.h) as Python reads it: op ids and stems, signal-slot ranges,
limits, dtype codes and GEMM tile ids, defined once in C++.

The compiled module exports the table (`_pk_ffi.op_table()`); without it (a pure-Python install)
the same facts come from `pk_jax/_op_table_data.py`, which `python -m pk_jax._gen_op_table`
writes from a built module. tests/test_op_table.py checks that the two agree.
"""

from __future__ import annotations


def _load() -> dict:
    try:
        from pk_jax import _pk_ffi  # type: ignore[attr-defined]
    except ImportError:  # pure-Python install, or a module built for another Python
        _pk_ffi = None
    if _pk_ffi is not None and hasattr(_pk_ffi, "op_table"):
        return _pk_ffi.op_table()
    from pk_jax._op_table_data import TABLE

    return TABLE


TABLE: dict = _load()
OPS: dict[str, dict] = {op["name"]: op for op in TABLE["ops"]}
# Op id -> stem, for the error record's op field (pk_jax/runtime/errors.py).
OP_NAMES: dict[int, str] = {op["id"]: op["name"] for op in TABLE["ops"]}
DTYPES: dict[str, int] = dict(TABLE["dtypes"])
TILES: dict[str, int] = dict(TABLE["tiles"])
LIMITS: dict[str, int] = dict(TABLE["limits"])
# The limits the Python ops check before they pick a kernel (outside them the reference runs):
MAX_PEERS: int = LIMITS["max_peers"]  # ranks of a communicator
MAX_DIM: int = LIMITS["max_dim"]  # sizes and products the kernels index in int32
MAX_GRID_Y: int = LIMITS["max_grid_y"]  # batch and heads: a grid's y and z extents
MAX_GROUPS: int = LIMITS["max_groups"]  # grouped GEMM groups (experts per rank)
GROUPED_FEW_MAX_ROWS: int = LIMITS["grouped_few_max_rows"]  # grouped GEMM: few-rows kernel M
MAX_EXPERTS: int = LIMITS["max_experts"]  # moe: E
MAX_SLOTS_PER_TOKEN: int = LIMITS["max_slots_per_token"]  # moe: k
MOE_MAX_COUNTS: int = LIMITS["moe_max_counts"]  # moe: P x E counts
MOE_MAX_FUSED_COUNTS: int = LIMITS["moe_max_fused_counts"]  # the fused dispatch + GEMM's
SIGNAL_COUNT: int = TABLE["signal_count"]
