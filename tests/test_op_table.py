"""The op table (ffi/op_table.h) is the one source of every op's id, stem, slot range, limits,
dtype codes and tile ids: the module's export, the checked-in Python mirror, the header, the
registered FFI handlers, the Python ops and the emulator must all agree with it."""

import ast
import itertools
import os
import pathlib
import re

import numpy as np
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
                                                   "int32": 3, "float8_e4m3fn": 4,
                                                   "float8_e5m2": 5}
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
    launch_h = (ROOT / "ffi" / "launch.h").read_text()
    body = launch_h[launch_h.index("constexpr auto WithLauncher("):]
    launched = {_snake(name) for name in re.findall(r"case kOp(\w+): return f\(", body)}
    assert launched == emu
    used = set(ops.OPS + ops.MOE + ops.ATTENTION + ops.FUSED_MOE + ops.FP8_GEMMS)
    assert used | {"ulysses_attn_bwd", "matmul", "matmul_fp8", "attention",
                   "grouped_matmul", "grouped_matmul_fp8"} == emu


@pytest.mark.needs_ext
@pytest.mark.parametrize("op", ["ping", "no_such_op"])
def test_the_emulator_refuses_ops_outside_the_table(op):
    with pytest.raises(ValueError, match=f"unknown op '{op}'"):
        _ffi._pk_ffi.emu_launch(op, 0, 0, 0, 1, {})


# ---------------------------------------------------------------------------------------------
# Each op's argument list, written once: its field visitor (ffi/launch.h VisitFields), which the
# emulator's decoder, the FFI handlers' fill check and _pk_ffi.op_fields() all walk. The launch
# dicts that pk_jax/testing (and the benchmarks) build must pass exactly the fields it names.


@pytest.mark.needs_ext
def test_op_fields_name_every_emulator_ops_arguments():
    fields = _ffi._pk_ffi.op_fields()
    assert set(fields) == {name for name, op in MIRROR_OPS.items() if op["emu"]}
    for name, named in fields.items():
        assert next(iter(named)) == "dtype", name
        # The rank operand is a communicator op's, as in the FFI handlers' Bind().
        assert ("rank" in named) == MIRROR_OPS[name]["comm"], name
    # The fallbacks the decoder has always used, now written once in the visitor.
    assert fields["matmul"]["config"] == MIRROR["tiles"]["128x128"]
    assert fields["matmul_fp8"]["config"] == MIRROR["tiles"]["128x128"]
    assert fields["matmul"]["group_m"] == fields["grouped_matmul"]["group_m"] == 8
    for name in ("ring_attn", "ring_attn_bwd", "ulysses_attn", "ulysses_attn_bwd"):
        assert fields[name]["num_comm_sms"] == 2, name
    assert fields["ag_gemm"]["num_comm_sms"] is None  # every call gives it
    assert fields["all_reduce"]["p0"] == fields["moe_dispatch_gemm"]["num_comm_sms"] == 0
    assert fields["attention"]["backward"] == 0


@pytest.mark.needs_ext
def test_emu_launch_decodes_python_dicts():
    """emu_launch's own decoding of a Python dict (module.cc PyDict over ffi/emu_decode.h), on a
    CPU: the launch functions' checks see what the dict holds, and return before any kernel."""
    launch = _ffi._pk_ffi.emu_launch
    with pytest.raises(KeyError, match="scale"):  # a float has no fallback
        launch("attention", 0, 0, 0, 1, {})
    assert launch("attention", 0, 0, 0, 1, {"scale": 0.5, "h": 1, "hkv": 1, "d": 64}) is None
    with pytest.raises(ValueError, match=r"pk_matmul: expected x \[M, K\]"):
        launch("matmul", 0, 0, 0, 1, {"m": 4, "n": 8, "k": 8, "y_rows": 3, "y_cols": 8})
    with pytest.raises(ValueError, match="unknown op 'ping'"):
        launch("ping", 0, 0, 0, 1, {})


def test_the_emulator_decodes_each_field_by_its_key():
    """emu_launch's decoder (ffi/emu_decode.h) on a CPU, through tests/cpp/fields.cc: the
    struct it would launch with, as a dict."""
    decode = _Fields.get().decode
    call = {"dtype": 1, "x": 4096, "w": 8192, "y": 12288, "m": 256, "k": 64, "n": 128,
            "y_rows": 256, "y_cols": 128}
    assert decode("matmul", call) == {**call, "config": 1, "group_m": 8}
    # Keys an op does not read are ignored: matmul has no rank operand and no x_full.
    assert decode("matmul", {**call, "rank": 5, "x_full": 7, "config": 0}) == {
        **call, "config": 0, "group_m": 8}
    assert decode("ag_gemm", {**call, "x_full": 7, "num_comm_sms": 3})["x_full"] == 7
    # A missing integer or pointer reads as its fallback (0 without one), as it always did.
    assert decode("all_reduce", {}) == {"dtype": 0, "x": 0, "y": 0, "rank": 0, "n": 0,
                                        "n_out": 0, "p0": 0}
    assert "p1" in decode("all_to_all", {}) and "p1" not in decode("all_gather", {})
    # matmul_fp8: three dtypes, two scale pointers and their shapes, the blockwise flag.
    fp8 = {"dtype": 4, "w_dtype": 5, "y_dtype": 2, "x": 4096, "w": 8192, "x_scale": 64,
           "w_scale": 128, "y": 12288, "m": 100, "k": 256, "n": 136, "y_rows": 100,
           "y_cols": 136, "xs_rows": 2, "xs_cols": 100, "ws_rows": 2, "ws_cols": 4}
    assert decode("matmul_fp8", {**fp8, "blockwise": 1}) == {
        **fp8, "blockwise": True, "config": 1, "group_m": 8}
    assert decode("matmul_fp8", {**fp8, "config": 0})["blockwise"] is False
    # grouped_matmul_fp8: matmul_fp8's fields with the group sizes and E; per-tensor tiles
    # fall back to 128x256.
    gfp8 = {**fp8, "group_sizes": 256, "groups": 3, "ws_rows": 6}
    assert decode("grouped_matmul_fp8", {**gfp8, "blockwise": 1}) == {
        **gfp8, "blockwise": True, "config": 0, "group_m": 8}
    # gemm_rs_fp8 / gemm_ar_fp8: matmul_fp8's fields and the rank operand.
    for op in ("gemm_rs_fp8", "gemm_ar_fp8"):
        assert decode(op, {**fp8, "rank": 64}) == {
            **fp8, "rank": 64, "blockwise": False, "config": 1, "group_m": 8}
        assert "rank" not in decode("matmul_fp8", {**fp8, "rank": 64})
        assert "x_full" not in decode(op, {**fp8, "rank": 64, "x_full": 7})
    # ag_gemm_fp8: also the gathered rows and scales and the communication blocks.
    ag = {**fp8, "rank": 64, "x_full": 7, "xs_full": 9, "num_comm_sms": 3}
    assert decode("ag_gemm_fp8", ag) == {**ag, "blockwise": False, "config": 1, "group_m": 8}
    # A missing float does not: scale has no fallback.
    with pytest.raises(KeyError):
        decode("ring_attn", {})
    fwd = decode("attention", {"scale": 0.5, "causal": 2, "o": 64, "lse": 128, "do": 256})
    assert (fwd["scale"], fwd["causal"], fwd["backward"], fwd["o"]) == (0.5, True, False, 64)
    assert "do" not in fwd and "sp" not in fwd
    bwd = decode("attention", {"scale": 0.5, "backward": 1, "o": 64, "do": 256, "sp": 384})
    assert (bwd["do"], bwd["sp"], bwd["backward"]) == (256, 384, True) and "o" not in bwd
    # The masks' fields only with masked, the segment operands only with segments too.
    assert "q_len" not in fwd and "soft_cap" not in fwd and fwd["masked"] is False
    masked = decode("attention", {"scale": 0.5, "masked": 1, "soft_cap": 30.0, "q_len": 64,
                                  "window_left": 5, "q_seg": 9})
    assert (masked["soft_cap"], masked["window_left"], masked["q_len"]) == (30.0, 5, 64)
    assert masked["segments"] is False and "q_seg" not in masked
    seg = decode("attention", {"scale": 0.5, "masked": 1, "soft_cap": 0.0, "segments": 1,
                               "q_seg": 9, "kv_info": 11})
    assert (seg["q_seg"], seg["kv_info"], seg["kv_seg"]) == (9, 11, 0)
    with pytest.raises(KeyError):  # the soft cap, a float, has no fallback
        decode("attention", {"scale": 0.5, "masked": 1})
    # ring_attn takes the same mask fields (over the whole sequence), read only when masked.
    plain = decode("ring_attn", {"scale": 1.0, "zigzag": 1, "q_len": 64})
    assert plain["masked"] is False and plain["zigzag"] is True and "q_len" not in plain
    rm = decode("ring_attn", {"scale": 1.0, "masked": 1, "soft_cap": 20.0, "segments": 1,
                              "kv_seg": 7, "window_right": 3, "q_len": 64})
    assert (rm["kv_seg"], rm["window_right"], rm["q_len"], rm["soft_cap"], rm["segments"]) == (
        7, 3, 64, 20.0, True)
    with pytest.raises(KeyError):  # the soft cap, a float, has no fallback
        decode("ring_attn", {"scale": 1.0, "masked": 1})
    ring = decode("ring_attn_bwd", {"scale": 1.0, "zigzag": 1, "lse": 512})
    assert (ring["num_comm_sms"], ring["zigzag"], ring["lse"]) == (2, True, 512)
    # The MoE ops' mode is the op's.
    assert [decode(op, {})["mode"] for op in ("moe_dispatch", "moe_scatter", "moe_combine",
                                              "moe_gather")] == [0, 1, 0, 1]
    assert "ids" not in decode("moe_scatter", {}) and "ids" in decode("moe_dispatch", {})
    with pytest.raises(ValueError, match="unknown op 'ping'"):
        decode("ping", {})


class _Fields:
    """tests/cpp/fields.cc, built with the host compiler against ffi/'s headers (the launch
    functions stubbed from ffi/launch.h's declarations: it launches nothing, so no kernel is
    compiled) and run once for the session: the emulator's decoder and the FFI handlers' fill
    check on a CPU, one command per line. Skips where there is no C++ compiler, CUDA's headers
    or XLA's FFI headers."""

    _shared = None

    @classmethod
    def get(cls) -> "_Fields":
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def __init__(self):
        import shutil
        import subprocess
        import tempfile

        import jax.ffi

        cxx, nvcc = shutil.which("g++") or shutil.which("c++"), shutil.which("nvcc")
        homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
                 nvcc and pathlib.Path(nvcc).resolve().parent.parent]
        includes = [pathlib.Path(h) / "include" for h in homes if h]
        cuda = next((i for i in includes if (i / "cuda_runtime_api.h").exists()), None)
        if cxx is None or cuda is None:
            pytest.skip("needs a C++ compiler and the CUDA toolkit's headers")
        launch_h = (ROOT / "ffi" / "launch.h").read_text()
        stubs = "".join(
            f"Status {name}({params}) {{ return Status::Invalid(\"stub\"); }}\n"
            for name, params in re.findall(r"^Status (Launch\w+)\(([^;]*?)\);", launch_h,
                                           re.MULTILINE | re.DOTALL))
        out = pathlib.Path(tempfile.mkdtemp(prefix="pk_jax_fields_"))
        (out / "stubs.cc").write_text(f'#include "launch.h"\nnamespace pk_ffi {{\n{stubs}}}\n')
        program = out / "fields"
        subprocess.run([cxx, "-std=c++17", "-O0", f"-I{ROOT / 'ffi'}", f"-I{cuda}",
                        f"-I{jax.ffi.include_dir()}", str(ROOT / "tests" / "cpp" / "fields.cc"),
                        str(out / "stubs.cc"), "-o", str(program)], check=True)
        self.proc = subprocess.Popen([str(program)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def _ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().rstrip("\n")

    def decode(self, op: str, args: dict) -> dict:
        """The launch dict `args` as the emulator decodes it for `op`: {field: value} of the
        fields it read (pointers as integers; the MoE ops also give their mode). KeyError for a
        float left out, ValueError for an unknown op, as emu_launch raises them."""
        text = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in args.items())
        answer = self._ask(f"decode {op} {text}")
        kind, _, rest = answer.partition(" ")
        if kind == "KeyError":
            raise KeyError(rest)
        if kind == "ValueError":
            raise ValueError(rest)
        assert kind == "ok", answer
        parse = {"i": int, "b": lambda v: v == "1", "f": float}
        fields = (item.split("=", 1) for item in rest.split())
        return {k: parse[v[0]](v[2:]) for k, v in fields}

    def fill(self, op: str, keys) -> str | None:
        """The FFI handlers' fill-check message when only `keys` are written, or None."""
        answer = self._ask(f"fill {op} {' '.join(keys)}")
        return None if answer == "ok" else answer


@pytest.mark.needs_ext
def test_the_ffi_fill_check_names_the_field_a_handler_left_out():
    """ffi_util.h MarkFields and CheckFilled, which every handler runs around its fill, on a
    CPU (tests/cpp/fill_check.cc): a handler that writes every field its op's visitor names
    passes; one that leaves out a field without a fallback fails naming it (flags cannot be
    marked and are not checked)."""
    fields, program = _ffi._pk_ffi.op_fields(), _Fields.get()
    for op, named in fields.items():
        for backward in (0, 1) if "backward" in named else (None,):
            call = {k: 0.5 if k == "scale" else 1 for k in named if k != "backward"}
            if backward:
                call["backward"] = 1
            read = program.decode(op, call)  # the fields of this call, typed
            keys = [k for k in read if k in call]
            assert program.fill(op, keys) is None, op
            for k in keys:
                if k == "backward":  # a flag that picks the fields, which the handler sets first
                    continue
                message = program.fill(op, [x for x in keys if x != k])
                if named[k] is not None or isinstance(read[k], bool):
                    assert message is None, (op, k)
                else:
                    assert message == (f"pk_jax: the {op} handler did not fill its argument "
                                       f"'{k}' (ffi/launch.h VisitFields)"), (op, k, message)


def _field_problems(op: str, args: dict, fields: dict, complete: bool = True) -> list[str]:
    """What is wrong with `args` as a launch dict of `op`: keys the op's decoder does not read,
    and (when `args` is all the call passes) fields without a fallback it leaves out."""
    if not complete:
        return [f"{op}: passes {k!r}, which it does not read"
                for k in sorted(set(args) - set(fields[op]))]
    try:
        read = _Fields.get().decode(op, args)
    except KeyError as e:
        return [f"{op}: leaves out {e.args[0]!r}"]
    unknown = sorted(set(args) - set(read))
    missing = sorted(k for k in read
                     if k in fields[op] and fields[op][k] is None and k not in args)
    return ([f"{op}: passes {k!r}, which it does not read" for k in unknown]
            + [f"{op}: leaves out {k!r}" for k in missing])


def _testing_launches(monkeypatch) -> list[tuple[str, dict]]:
    """(op, fields) of every launch pk_jax.testing's cases, its composed Ulysses backward and
    World.matmul_tflops make, exactly as World.launch hands them to emu_launch, on a World
    whose buffers are addresses and whose emu_launch records instead of launching."""
    from pk_jax.testing import emulator, ops, ulysses_bwd

    addresses = itertools.count(1)

    class Buffer(emulator.DeviceBuffer):
        def __init__(self, nbytes: int):
            self.nbytes, self.ptr = int(nbytes), next(addresses) << 12

        def write(self, a) -> None:
            pass

        def fill(self, byte: int) -> None:
            pass

        def free(self) -> None:
            self.ptr = 0

    class Module:  # _pk_ffi's emulator entry points
        def __init__(self):
            self.calls = []

        def emu_launch(self, op, comm_id, device, stream, num_sms, fields):
            self.calls.append((op, dict(fields)))

        def emu_delay(self, stream, ns):
            pass

    for module in (emulator, ops, ulysses_bwd):
        monkeypatch.setattr(module, "DeviceBuffer", Buffer)
    p = 2
    world = emulator.World.__new__(emulator.World)
    world.world, world.device, world.comm_base, world.scale = p, 0, 1 << 40, None
    world.parts = [emulator.Partition(None, 10 + r, 20 + r, 16) for r in range(p)]
    world.ranks = [Buffer(4) for _ in range(p)]
    world._ffi = Module()
    world.synchronize = lambda timeout_s=None: 0.0

    rng = np.random.default_rng(0)
    rand = lambda *shape: ops.integers(rng, shape)
    xs, ws = [rand(256, 64) for _ in range(p)], [rand(64, 64) for _ in range(p)]
    ids = rng.integers(0, 4, size=(p, 4, 2))
    moe = {"num_experts": 4, "capacity": 8}
    q, k, v, do = ([rand(1, 64, 2, 8) for _ in range(p)] for _ in range(4))
    bwd = ops.ring_attn_bwd(q, k, v, do, "bfloat16", causal=True)
    cases = [
        ops.all_reduce([rand(4, 8) for _ in range(p)], "float32"),
        ops.all_gather([rand(4, 8) for _ in range(p)], "float32"),
        ops.reduce_scatter([rand(4, 8) for _ in range(p)], "float32"),
        ops.all_to_all([rand(4, 8) for _ in range(p)], "float32", 0, 1),
        ops.gemm_rs(xs, ws, "bfloat16"), ops.gemm_ar(xs, ws, "bfloat16"),
        ops.ag_gemm(xs, ws, "bfloat16"),
        ops.gemm_rs_fp8(xs, [w.T for w in ws], [1.0] * p, [0.5] * p),
        ops.gemm_ar_fp8(xs, [w.T for w in ws], [2.0] * p, [1.0] * p,
                        x_format="float8_e5m2", w_format="float8_e4m3fn"),
        ops.ag_gemm_fp8(xs, [w.T for w in ws], [1.0] * p, [0.5] * p),
        ops.moe_dispatch([rand(4, 8) for _ in range(p)], ids, "bfloat16", **moe),
        ops.moe_scatter([rand(8, 8) for _ in range(p)], ids, "bfloat16", **moe),
        ops.moe_combine([rand(8, 8) for _ in range(p)], rng.random((p, 4, 2)), ids, "bfloat16",
                        num_experts=4),
        ops.moe_combine([rand(8, 8) for _ in range(p)], rng.random((p, 4, 2)), ids, "bfloat16",
                        num_experts=4, gather=True),
        ops.moe_dispatch_gemm([rand(4, 8) for _ in range(p)], ids,
                              [rand(2, 8, 8) for _ in range(p)], "bfloat16", **moe),
        ops.moe_gemm_combine([rand(8, 8) for _ in range(p)], [rand(2, 8, 8) for _ in range(p)],
                             rng.random((p, 4, 2)), ids, "bfloat16", **moe),
        ops.ring_attn(q, k, v, "bfloat16", causal=True, zigzag=True),
        ops.ulysses_attn(q, k, v, "bfloat16", causal=False), bwd,
        ulysses_bwd.fused_reference(bwd),
    ]
    for case in cases:
        ops.Call(world, case).launch()
    ulysses_bwd.UlyssesBackward(world, "bfloat16", *ulysses_bwd.reference_inputs(bwd),
                                causal=True, scale=bwd.params["scale"]).launch()
    world.matmul_tflops(m=128, n=128, k=64)
    return world._ffi.calls


@pytest.mark.needs_ext
def test_pk_jax_testing_passes_exactly_the_fields_each_op_reads(monkeypatch):
    fields = _ffi._pk_ffi.op_fields()
    calls = _testing_launches(monkeypatch)
    problems = sorted({p for op, args in calls for p in _field_problems(op, args, fields)})
    assert not problems, problems
    # Every emulator op is launched but grouped_matmul, which only the benchmarks launch (the
    # next test reads their dicts), and matmul_fp8 and grouped_matmul_fp8, which only XLA
    # launches (their fields are checked by the decoder and fill-check tests above).
    assert {op for op, _ in calls} == set(fields) - {"grouped_matmul", "matmul_fp8",
                                                     "grouped_matmul_fp8"}


def _written_launch_dicts(paths) -> list[tuple[str, str, dict, bool]]:
    """(where, op, keys, complete) of every launch dict written out in `paths`: the dict of a
    World.launch(op, rank, dict) or World.call(op, dicts) call, a literal or one assigned (or
    appended) to the name it passes, with the literal's keys (values: 1, scale 0.5, backward
    as written). complete: the literal is all the call passes (no ** and no later update)."""
    out = []
    for path in paths:
        tree = ast.parse(path.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            bound, updated = {}, set()
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                        node.targets[0], ast.Name):
                    value = node.value
                    value = value.elt if isinstance(value, ast.ListComp) else value
                    if isinstance(value, ast.Dict):
                        bound.setdefault(node.targets[0].id, []).append(value)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                      and isinstance(node.func.value, ast.Name)):
                    name = node.func.value.id
                    if (node.func.attr == "append" and node.args
                            and isinstance(node.args[0], ast.Dict)):
                        bound.setdefault(name, []).append(node.args[0])
                    elif node.func.attr == "update":
                        updated.add(name)
            for node in ast.walk(fn):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("launch", "call") and node.args
                        and isinstance(node.args[0], ast.Constant)):
                    continue
                op, arg = node.args[0].value, node.args[-1]
                if isinstance(arg, ast.Dict):
                    dicts, direct = [arg], True
                else:
                    name = arg.value if isinstance(arg, ast.Subscript) else arg
                    if not isinstance(name, ast.Name) or name.id not in bound:
                        continue
                    dicts, direct = bound[name.id], name.id not in updated
                for d in dicts:
                    keys, complete = {}, direct
                    for key, value in zip(d.keys, d.values):
                        if not isinstance(key, ast.Constant):  # **other, or a computed key
                            complete = False
                        elif key.value == "scale":
                            keys[key.value] = 0.5
                        elif key.value == "backward" and isinstance(value, ast.Constant):
                            keys[key.value] = value.value
                        else:
                            keys[key.value] = 1
                    out.append((f"{path.relative_to(ROOT)}:{node.lineno}", op, keys, complete))
    return out


@pytest.mark.needs_ext
def test_the_benchmarks_launch_dicts_pass_only_fields_their_ops_read():
    fields = _ffi._pk_ffi.op_fields()
    paths = sorted([*(ROOT / "bench").glob("*.py"), *(ROOT / "tests" / "gpu").glob("*.py")])
    found = [w for w in _written_launch_dicts(paths) if w[1] in fields]
    problems = set()
    for where, op, keys, complete in found:
        if MIRROR_OPS[op]["comm"]:  # World.launch passes the rank operand
            keys = {**keys, "rank": 1}
        problems |= {f"{where}: {p}" for p in _field_problems(op, keys, fields, complete)}
    problems = sorted(problems)
    assert not problems, problems
    assert "grouped_matmul" in {op for _, op, _, _ in found}


# FFI attributes that are no visitor field of their own name: the communicator handlers'
# comm_id (their instantiate stage's), the collectives' parameters (CollArgs' p0 and p1), and
# the modes the emulator spells as ops (moe_combine's: moe_gather) or does not run
# (grouped_matmul's DX and DW).
FFI_ATTRIBUTE_FIELDS = {"comm_id": None, "algo": "p0", "run": "p0", "split_run": "p0",
                        "concat_run": "p1", "mode": None}


@pytest.mark.needs_ext
def test_ffi_attributes_are_named_as_the_visitor_names_them():
    """XLA's typed Bind() keeps its own attribute list (compile time); its names are the
    visitor's, so a Python lowering, the handler and the emulator's dicts say one name."""
    fields = _ffi._pk_ffi.op_fields()
    files: dict[str, set] = {}
    for name in fields:
        own = ROOT / "ffi" / f"{name}.cu"
        path = own if own.exists() else ROOT / "ffi" / f"{MIRROR_OPS[name]['family']}.cu"
        files.setdefault(path, set()).update(fields[name])
    for path, named in files.items():
        attributes = set(re.findall(r'\.Attr<[^>]*>\("(\w+)"\)', path.read_text()))
        assert attributes, path
        for attribute in attributes:
            field = FFI_ATTRIBUTE_FIELDS.get(attribute, attribute)
            assert field is None or field in named, f"{path.name}: attribute {attribute!r}"


def test_the_python_ops_take_the_kernels_limits_from_the_table():
    """The ops' checks before they pick a kernel use the op table's limits (pk_jax/_op_table.py
    MAX_*), not copies: no literal grid extent (65535 / 65536) or int32 bound (2**31, 2**30)
    in pk_jax/ops, and the MoE and grouped GEMM limits are the table's."""
    from pk_jax.ops import grouped_matmul, moe

    literal = re.compile(r"\b6553[56]\b|\b2 ?\*\* ?3[01]\b|\b1 << 3[01]\b")
    found = [f"{path.name}:{i}" for path in sorted((ROOT / "pk_jax" / "ops").glob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if literal.search(line)]
    assert not found, found
    limits = MIRROR["limits"]
    assert (moe.KERNEL_MAX_PEERS, moe.KERNEL_MAX_EXPERTS, moe.KERNEL_MAX_K,
            moe.KERNEL_MAX_COUNTS, moe.KERNEL_MAX_FUSED_COUNTS, grouped_matmul.MAX_GROUPS) == (
        limits["max_peers"], limits["max_experts"], limits["max_slots_per_token"],
        limits["moe_max_counts"], limits["moe_max_fused_counts"], limits["max_groups"])
    assert limits["max_grid_y"] == 65535 and limits["max_dim"] == 2**31 - 1
