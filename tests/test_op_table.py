"""The op table (ffi/op_table.h) is the one source of every op's id, stem, slot range, limits,
dtype codes and tile ids: the module's export, the checked-in Python mirror, the header, the
registered FFI handlers, the Python ops and the emulator must all agree with it."""

import itertools
import pathlib
import re

import pytest

from pk_jax import _ffi, _gen_op_table, _op_table, _op_table_data
from pk_jax.runtime import comm, errors

ROOT = pathlib.Path(__file__).resolve().parent.parent
HEADER = (ROOT / "ffi" / "op_table.h").read_text()
MIRROR = _op_table_data.TABLE
MIRROR_OPS = {op["name"]: op for op in MIRROR["ops"]}


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


@pytest.mark.needs_ext
def test_the_module_exports_the_mirrored_table():
    assert _ffi._pk_ffi.op_table() == MIRROR, (
        "pk_jax/_op_table_data.py is stale: run `python -m pk_jax._gen_op_table` after the build")


def test_the_mirror_is_what_the_generator_writes():
    path = ROOT / "pk_jax" / "_op_table_data.py"
    assert path.read_text() == _gen_op_table.render(MIRROR)


def test_the_mirror_has_the_headers_op_ids_and_dtype_codes():
    ids = {_snake(name): int(v) for name, v in re.findall(r"\bkOp([A-Z]\w*) = (\d+)", HEADER)}
    assert ids == {name: op["id"] for name, op in MIRROR_OPS.items()}
    enum = re.search(r"enum class DType : int32_t \{([^}]*)\}", HEADER).group(1)
    codes = dict(re.findall(r"(k\w+) = (\d+)", enum))
    entries = re.findall(r'\{"(\w+)", DType::(k\w+), \d\}', HEADER)
    assert {name: int(codes[k]) for name, k in entries} == MIRROR["dtypes"]
    tiles = dict(re.findall(r"(kTile\w+) = (\d+)", HEADER))
    entries = re.findall(r'\{"(\w+)", (kTile\w+)\}', HEADER)
    assert {name: int(tiles[k]) for name, k in entries} == MIRROR["tiles"]


def test_python_reads_its_facts_from_the_table():
    from pk_jax.testing import emulator, ops

    assert errors.OP_NAMES == {op["id"]: op["name"] for op in _op_table.TABLE["ops"]}
    assert comm.DEFAULT_SIGNAL_COUNT == _op_table.SIGNAL_COUNT == MIRROR["signal_count"]
    assert emulator.DTYPES == MIRROR["dtypes"] == {"bfloat16": 0, "float16": 1, "float32": 2,
                                                   "int32": 3}
    assert (ops.TILE_128x128, ops.TILE_128x256_S3) == (1, 2)  # what the fused GEMMs take


def test_python_limits_and_tile_ids_equal_the_tables():
    """The ops' own copies (pk_jax/ops/*.py) must equal the table until they read it."""
    from pk_jax.ops import grouped_matmul, matmul, moe

    limits, tiles = MIRROR["limits"], MIRROR["tiles"]
    assert moe.KERNEL_MAX_PEERS == limits["max_peers"]
    assert moe.KERNEL_MAX_EXPERTS == limits["max_experts"]
    assert moe.KERNEL_MAX_K == limits["max_slots_per_token"]
    assert moe.KERNEL_MAX_COUNTS == limits["moe_max_counts"]
    assert moe.KERNEL_MAX_FUSED_COUNTS == limits["moe_max_fused_counts"]
    assert grouped_matmul.MAX_GROUPS == limits["max_groups"]
    assert limits["max_dim"] == 2**31 - 1 and limits["max_grid_y"] == 65535
    assert (matmul._TILE_128x256, matmul._TILE_128x128, matmul._TILE_128x256_S3) == (
        tiles["128x256"], tiles["128x128"], tiles["128x256_s3"])


def test_ids_are_unique_and_records_name_ops():
    ids = [op["id"] for op in MIRROR["ops"]]
    assert len(set(ids)) == len(ids) and min(ids) > 0
    assert all(op["record_id"] in ids for op in MIRROR["ops"])
    # The ids every kernel wrote before the table existed keep their meaning.
    old = {1: "all_reduce", 2: "all_gather", 3: "reduce_scatter", 4: "all_to_all",
           5: "gemm_rs", 6: "ag_gemm", 7: "gemm_ar", 12: "moe_dispatch", 13: "moe_combine",
           14: "ring_attn", 15: "ulysses_attn", 16: "ring_attn_bwd", 17: "moe_gemm_combine",
           18: "ulysses_attn_bwd"}
    assert {i: errors.OP_NAMES[i] for i in old} == old


def test_slot_ranges_are_disjoint_and_fit_the_pad():
    ranges = {(op["slot_base"], op["slot_count"]) for op in MIRROR["ops"] if op["slot_count"]}
    spans = sorted(ranges)
    for (b0, c0), (b1, _) in itertools.pairwise(spans):
        assert b0 + c0 <= b1, f"slot ranges [{b0}, {b0 + c0}) and [{b1}, ...) overlap"
    assert spans[-1][0] + spans[-1][1] <= MIRROR["signal_count"]
    for op in MIRROR["ops"]:
        assert (op["slot_count"] > 0) == op["comm"], op["name"]
    # Ops of one family with a communicator share one range (one epoch).
    assert MIRROR_OPS["ring_attn_bwd"]["slot_base"] == MIRROR_OPS["ring_attn"]["slot_base"]


def test_every_op_has_its_files():
    for name, op in MIRROR_OPS.items():
        fam = op["family"]
        for path in (f"ffi/{fam}.cu", f"cuda/kernels/{fam}.cuh", f"pk_jax/ops/{fam}.py",
                     f"tests/test_{fam}.py", f"bench/bench_{fam}.py"):
            assert (ROOT / path).exists(), f"{name}: no {path}"


def test_python_ops_call_exactly_the_tables_targets():
    called = set()
    for path in sorted((ROOT / "pk_jax" / "ops").glob("*.py")):
        text = path.read_text()
        called |= set(re.findall(r'"pk_(\w+)"', text))
        stem = re.search(r'^STEM = "(\w+)"', text, re.MULTILINE)
        if 'f"pk_{STEM}"' in text:
            called.add(stem.group(1))
    assert called == {name for name, op in MIRROR_OPS.items() if op["target"]}


@pytest.mark.needs_ext
def test_registered_handlers_are_the_tables_targets():
    regs = [(t.removeprefix("pk_"), h) for t, plat, h in _ffi.registrations() if plat == "CUDA"]
    assert {name for name, _ in regs} == {n for n, op in MIRROR_OPS.items() if op["target"]}
    for name, handler in regs:  # a communicator handler has an instantiate stage
        assert isinstance(handler, dict) == MIRROR_OPS[name]["comm"], name


def test_emulator_ops_are_the_tables():
    from pk_jax.testing import ops

    emu = {name for name, op in MIRROR_OPS.items() if op["emu"]}
    launched = set(re.findall(r'\bop == "(\w+)"', (ROOT / "ffi" / "module.cc").read_text()))
    assert launched == emu
    used = set(ops.OPS + ops.MOE + ops.ATTENTION + ops.FUSED_MOE)
    assert used | {"ulysses_attn_bwd", "matmul", "attention", "grouped_matmul"} == emu


@pytest.mark.needs_ext
@pytest.mark.parametrize("op", ["ping", "no_such_op"])
def test_the_emulator_refuses_ops_outside_the_table(op):
    with pytest.raises(ValueError, match=f"unknown op '{op}'"):
        _ffi._pk_ffi.emu_launch(op, 0, 0, 0, 1, {})
