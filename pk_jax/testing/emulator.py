"""The rank emulator: P ranks on disjoint SM partitions of one GPU, in one process.

Green contexts split the GPU's SMs into partitions whose kernels run at the same time, so a
multi-rank kernel meets its peers at memory speed and races, missing fences and deadlocks show,
unlike ranks in several processes sharing a GPU, which time-slice.

What a `World` holds, and how it mirrors a real P-GPU communicator:

- one green context per rank (its SM partition) with a stream on it;
- P symmetric allocations laid out exactly as `pk.init` lays out one per device
  (`pk_jax.runtime.comm.layout`: workspace at offset 0, then the signal pad), made with the
  same VMM calls (`pk_jax.runtime.vmm`), zeroed, and one host-mapped error record;
- one communicator view per rank registered in the extension's communicator table, as
  `pk.init` registers one per device (rank r sees every peer's workspace and pad);
- ops started by `pk_jax._pk_ffi.emu_launch`, which calls the same C++ launch function the
  op's FFI handler calls (ffi/launch.h), on the rank's stream with the partition's SM count.

A rank can start late (`delays_ns`: a spinning kernel queued before its op) or never (`skip`).
Every host wait is bounded (`World.synchronize`), and every device wait is bounded by the
world's `timeout_s`: a rank that never arrives makes the others record the error (op, rank,
missing peer) and trap; that process's CUDA context is then unusable (as after any kernel
trap): `World.close` releases what it can, and a new process starts clean.

What it cannot show: NVLink speed. Each rank has 1/P of the SMs and all ranks share one HBM.

The scale model (`World(P, scale_model=True)`): rank r is a 1/P model of one GPU of an 8-GPU
NVLink node in every dimension that decides overlap. Compute, HBM and L2 scale with its SM
partition; the link is throttled so that the partition's measured matmul rate over the link
rate is a real node's FLOP per byte (1750); communication resources scale too: an op asking
for c communication SMs (the `num_comm_sms` launch field, read as the count on a 132-SM GPU)
gets `node_comm_sms(c, sms_per_rank)` = max(1, round(c * sms_per_rank / 132)) on the partition.
The link is asynchronous, as on a real GPU (cuda/include/pk/link.cuh): an issued store
reserves link time and its thread goes on; the source's reuse, the signal and the kernel's end
wait for the bytes. Only rows measured this way decide anything (docs/performance.md, "Overlap at the scale model").

The link throttle (`link_gbps`, `set_link`; cuda/include/pk/link.cuh): caps the rate at which
each rank's kernels move bytes to or from other ranks' workspaces, a per-rank device-side
token bucket on a link clock in device memory. Unthrottled, an emulated rank computes about
790/P TFLOP/s and moves data at about 3.3/P TB/s of shared HBM (~240 FLOP per byte); a real
NVLink H100/H200 node is ~1750 (790 TFLOP/s against 450 GB/s per direction), so overlap
barely matters without it. `real_node_link_gbps(tflops_per_rank)` gives the cap that restores
a real node's ratio. Only the emulator sets it: pk.init's communicators never pace.

Needs CUDA_MODULE_LOADING=EAGER set before CUDA starts (`require_eager_loading` says why).
Under compute-sanitizer at P = 8, also CUDA_DEVICE_MAX_CONNECTIONS=32: with the default 8
hardware work queues, ranks 4-7 never started (most likely queued behind ranks 0-3's kernels,
which wait for them; on the H200 32 fixed it; tests/gpu/run_all.sh sets it).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np

from pk_jax import _op_table
from pk_jax.runtime import comm, errors, vmm

# Communicator ids of emulated worlds: far above the ids pk.init uses (mesh axis indices).
_EMU_COMM_BASE = 1 << 40
# FLOP per byte of a real NVLink H100/H200 node: 790 TFLOP/s (bf16 dense) against 450 GB/s
# per GPU per direction.
REAL_NODE_FLOP_PER_BYTE = 1750.0
# SMs of the GPU the scale model scales from (H100/H200 SXM).
NODE_SMS = 132


def node_comm_sms(c_on_node: int, sms_per_rank: int, node_sms: int = NODE_SMS) -> int:
    """Communication SMs on a partition of `sms_per_rank` SMs for an op that would use
    `c_on_node` of a whole GPU's `node_sms`: max(1, round(c * sms_per_rank / node_sms))."""
    if c_on_node <= 0:
        return int(c_on_node)  # 0: the launcher's own choice, already relative to the SMs
    return max(1, round(c_on_node * sms_per_rank / node_sms))


def real_node_link_gbps(tflops_per_rank: float,
                        flop_per_byte: float = REAL_NODE_FLOP_PER_BYTE) -> float:
    """The link cap (GB/s per rank) giving an emulated rank that computes `tflops_per_rank`
    a real node's FLOP/byte ratio: tflops * 1e12 / flop_per_byte / 1e9."""
    return float(tflops_per_rank) * 1e3 / float(flop_per_byte)

_world_ids = itertools.count()

DTYPES = _op_table.DTYPES  # the launchers' dtype codes (ffi/op_table.h), by numpy name


class EmulatorError(RuntimeError):
    """An emulated call failed: a kernel recorded an error (the message names the op, the rank
    and the missing peer) or trapped, or a host wait ran past its bound."""

    def __init__(self, message: str, record: tuple[int, ...] = (0,) * errors.RECORD_WORDS,
                 elapsed_s: float = 0.0):
        super().__init__(message)
        self.record = tuple(record)
        self.elapsed_s = elapsed_s


def np_dtype(name: str):
    """The numpy dtype of `name` (bfloat16 through ml_dtypes, which jax ships)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class DeviceBuffer:
    """A plain device allocation (cuMemAlloc) of the primary context, filled from numpy.

    NOTES: `write` and `fill` return only once the data is in place (a context synchronize
    after the copy or memset). cuMemsetD8 is asynchronous for device memory, and a pageable
    cuMemcpyHtoD may return before its DMA lands; both run on the primary context's legacy
    stream, which is not ordered with the ranks' non-blocking green-context streams. Without
    the synchronize, the last buffers filled before a launch could land while the kernels
    run: a late-rank test saw the last rank's poison land inside moe_dispatch's count
    exchange, stretched to 200 ms by a late rank (cuda/kernels/moe.cuh NOTES).
    """

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self.ptr = int(vmm.call("cuMemAlloc", max(self.nbytes, 16)))

    @classmethod
    def from_array(cls, a: np.ndarray) -> DeviceBuffer:
        a = np.ascontiguousarray(a)
        buf = cls(a.nbytes)
        buf.write(a)
        return buf

    def write(self, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a)
        if a.nbytes > self.nbytes:
            raise ValueError(f"DeviceBuffer: {a.nbytes} bytes do not fit in {self.nbytes}.")
        if a.nbytes:
            vmm.call("cuMemcpyHtoD", self.ptr, a.ctypes.data, a.nbytes)
            vmm.call("cuCtxSynchronize")

    def read(self, dtype, shape) -> np.ndarray:
        out = np.empty(shape, dtype)
        if out.nbytes:
            vmm.call("cuMemcpyDtoH", out.ctypes.data, self.ptr, out.nbytes)
        return out

    def fill(self, byte: int) -> None:
        """Poisons the buffer with one byte value (0xFF: NaNs in every float type)."""
        vmm.call("cuMemsetD8", self.ptr, int(byte) & 0xFF, self.nbytes)
        vmm.call("cuCtxSynchronize")

    def fill_async(self, byte: int) -> None:
        """The same poison queued on the primary context's legacy stream, returning at once:
        unordered with the ranks' streams, as `fill` was before its synchronize (a writer that
        races the kernels, for tests/gpu/test_emulator_moe.py)."""
        cu = vmm.driver()
        vmm.call("cuMemsetD8Async", self.ptr, int(byte) & 0xFF, self.nbytes, cu.CUstream(0))

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            try:
                vmm.call("cuMemFree", ptr)
            except vmm.CudaError:  # a trapped context: freed when the process ends
                pass


@dataclass
class Partition:
    """One emulated rank's share of the GPU: a green context and its streams."""

    green_ctx: object
    stream: int
    side_stream: int  # for work that competes with the rank's ops (LaunchOccupy)
    sms: int


def sm_resource(device: int):
    cu = vmm.driver()
    dev = vmm.call("cuDeviceGet", device)
    return cu, dev, vmm.call("cuDeviceGetDevResource", dev,
                             cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM)


def split_sms(device: int, sms_per_rank: list[int]) -> list[Partition]:
    """Green contexts with the given SM counts (each a multiple of the split unit, 8 on H200).

    The device's SMs are split into groups of the smallest count asked for (disjoint, as
    cuDevSmResourceSplitByCount guarantees); rank r's context is made from as many consecutive
    groups as its count needs.
    """
    cu, dev, res = sm_resource(device)
    unit = min(sms_per_rank)
    need = sum(sms_per_rank)
    if unit <= 0 or any(s % unit for s in sms_per_rank):
        raise ValueError(f"split_sms: every SM count must be a multiple of the smallest, got "
                         f"{sms_per_rank}.")
    groups_wanted = need // unit
    err, groups, n_groups, _remaining = cu.cuDevSmResourceSplitByCount(groups_wanted, res, 0,
                                                                       unit)
    if err != cu.CUresult.CUDA_SUCCESS or n_groups < groups_wanted:
        raise ValueError(
            f"split_sms: the GPU's {res.sm.smCount} SMs give only {n_groups} partitions of "
            f"{unit} SMs ({err}), and {sms_per_rank} needs {groups_wanted}.")
    parts: list[Partition] = []
    g = 0
    try:
        for count in sms_per_rank:
            take = list(groups[g:g + count // unit])
            g += count // unit
            desc = vmm.call("cuDevResourceGenerateDesc", take, len(take))
            gctx = vmm.call("cuGreenCtxCreate", desc, dev,
                            cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
            flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
            streams = [vmm.call("cuGreenCtxStreamCreate", gctx, flags, 0) for _ in range(2)]
            parts.append(Partition(gctx, int(streams[0]), int(streams[1]),
                                   sum(int(t.sm.smCount) for t in take)))
    except BaseException:
        destroy_partitions(parts)
        raise
    return parts


def destroy_partitions(parts: list[Partition]) -> None:
    cu = vmm.driver()
    for p in parts:
        for s in (p.stream, p.side_stream):
            cu.cuStreamDestroy(cu.CUstream(s))
        cu.cuGreenCtxDestroy(p.green_ctx)


def max_partitions(device: int = 0, sms: int = 16) -> int:
    """How many disjoint partitions of `sms` SMs the GPU gives."""
    cu, _, res = sm_resource(device)
    err, _, n, _ = cu.cuDevSmResourceSplitByCount(0, res, 0, sms)
    return int(n) if err == cu.CUresult.CUDA_SUCCESS else 0


def require_eager_loading() -> None:
    """Raises unless CUDA loads modules eagerly (CUDA_MODULE_LOADING=EAGER before CUDA starts).

    NOTES: with lazy loading (CUDA's default) the first launch of a kernel loads it, and the
    load waits until the context's running kernels finish. Rank 0's enter kernel, spinning
    until rank 1 arrives, then blocks the host's launch of rank 0's GEMM, so rank 1's kernels
    are never queued: a deadlock that ends in the timeout (seen on the H200). One process
    driving several GPUs whose kernels wait for each other can meet the same.
    """
    cu = vmm.driver()
    mode = vmm.call("cuModuleGetLoadingMode")
    if mode != cu.CUmoduleLoadingMode.CU_MODULE_EAGER_LOADING:
        raise RuntimeError(
            "pk_jax.testing.World needs CUDA_MODULE_LOADING=EAGER in the environment before "
            "CUDA starts (before jax or cuda-python first touch the GPU): with lazy loading, "
            "launching a kernel for the first time waits for the running kernels of the "
            "context, which wait for the ranks not launched yet.")


class World:
    """P emulated ranks of one communicator on one GPU (see the module docstring).

    Args:
        world: the number of ranks P (2..16).
        sms_per_rank: SMs of each rank's partition: one int for all, or a list of P (unequal
            partitions). Default: the largest equal share in multiples of 8.
        workspace_bytes: bytes of each rank's symmetric workspace.
        timeout_s: how long a kernel waits for a peer before it records the error and traps.
        device: the GPU ordinal.
        link_gbps: the link throttle, GB/s (1e9 bytes/s) per rank of cross-rank traffic;
            None or 0: unthrottled (the shared HBM's rate). See `set_link`.
        scale_model: make each rank a 1/P scale model of one GPU of a real node (the module
            docstring): measures the partitions' matmul rate, throttles the link to
            `flop_per_byte` and scales `num_comm_sms`. Excludes `link_gbps`.
        flop_per_byte: the real node's FLOP per byte the scale model reproduces.
    """

    def __init__(self, world: int, *, sms_per_rank: int | list[int] | None = None,
                 workspace_bytes: int = 16 << 20, timeout_s: float = 5.0, device: int = 0,
                 link_gbps: float | None = None, scale_model: bool = False,
                 flop_per_byte: float = REAL_NODE_FLOP_PER_BYTE):
        from pk_jax import _ffi

        if not _ffi.HAS_CUDA or not hasattr(_ffi._pk_ffi, "emu_launch"):
            raise RuntimeError("pk_jax.testing.World needs the CUDA extension with the emulator "
                               f"entry points ({_ffi.IMPORT_ERROR}).")
        if not 1 <= world <= 16:
            raise ValueError(f"World: world must be in 1..16, got {world}.")
        require_eager_loading()
        self._ffi = _ffi._pk_ffi
        self.world, self.device, self.timeout_s = int(world), int(device), float(timeout_s)
        self.workspace_bytes = int(workspace_bytes)
        self.signal_count = comm.DEFAULT_SIGNAL_COUNT
        self.comm_base = _EMU_COMM_BASE + 64 * next(_world_ids)
        self._ctx = vmm.Context(self.device)
        self._ctx.__enter__()
        self.parts: list[Partition] = []
        self.allocations: list[vmm.Allocation] = []
        self.mappings: list[vmm.Mapping] = []
        self.ranks: list[DeviceBuffer] = []
        self.record: vmm.HostRecord | None = None
        self.registered: list[int] = []
        self.link_clocks: list[DeviceBuffer] = []
        self.link_gbps = 0.0
        self.scale: dict | None = None  # the scale model's constants, when on
        self.closed = False
        try:
            if sms_per_rank is None:
                _, _, res = sm_resource(self.device)
                sms_per_rank = max(8, int(res.sm.smCount) // self.world // 8 * 8)
            if isinstance(sms_per_rank, int):
                sms_per_rank = [sms_per_rank] * self.world
            if len(sms_per_rank) != self.world:
                raise ValueError(f"World: sms_per_rank needs {self.world} entries, got "
                                 f"{len(sms_per_rank)}.")
            self.parts = split_sms(self.device, list(sms_per_rank))
            self._build_memory()
            if scale_model and link_gbps:
                raise ValueError("World: scale_model sets the link itself; drop link_gbps.")
            if link_gbps:
                self.set_link(link_gbps)
            if scale_model:
                self._scale_model(float(flop_per_byte))
        except BaseException:
            self.close()
            raise

    def _build_memory(self) -> None:
        gran = vmm.granularity(self.device)
        self.signal_offset, self.allocation_bytes = comm.layout(self.workspace_bytes,
                                                                self.signal_count, gran)
        for _ in range(self.world):
            alloc = vmm.Allocation.create(self.device, self.allocation_bytes)
            self.allocations.append(alloc)
            mapping = vmm.Mapping(alloc, [self.device], alignment=gran)
            self.mappings.append(mapping)
            vmm.memset_d8(mapping.ptr, 0, mapping.size)
        self.record = vmm.HostRecord(errors.RECORD_BYTES)
        self._register(self.workspace_bytes)
        self.ranks = [DeviceBuffer.from_array(np.array([r], np.int32)) for r in range(self.world)]

    def _register(self, workspace_bytes: int) -> None:
        ptrs = [m.ptr for m in self.mappings]
        for r in range(self.world):
            self._ffi.comm_register(self.comm_base + r, self.device, r, self.world, ptrs,
                                    [p + self.signal_offset for p in ptrs],
                                    workspace_bytes, self.signal_count,
                                    int(self.timeout_s * 1e9), self.record.device_ptr)
            self.registered.append(self.comm_base + r)

    def limit_workspace(self, nbytes: int | None) -> None:
        """Re-registers every rank declaring only `nbytes` of its workspace (None: all of it),
        over the same memory and signal pads: calls that need more are refused by the
        launchers' workspace checks. Call between calls (after `synchronize`)."""
        nbytes = self.workspace_bytes if nbytes is None else int(nbytes)
        if not 0 <= nbytes <= self.workspace_bytes:
            raise ValueError(f"World.limit_workspace: nbytes must be in 0..{self.workspace_bytes},"
                             f" got {nbytes}.")
        for cid in self.registered:
            self._ffi.comm_unregister(cid, self.device)
        self.registered = []
        self._register(nbytes)
        if self.link_gbps:
            self.set_link(self.link_gbps)

    def set_link(self, gbps: float | None) -> None:
        """Caps every rank's cross-rank traffic at `gbps` GB/s (None or 0: unthrottled).

        Each rank gets a link clock (8 bytes of device memory, zeroed) that its kernels
        reserve time on before moving bytes to or from a peer's workspace (pk/link.cuh), so
        its aggregate rate never exceeds the cap, however many blocks or kernels move data.
        Call between calls (after `synchronize`), not while kernels run.
        """
        gbps = float(gbps or 0.0)
        if gbps < 0 or (0 < gbps < 0.1):
            raise ValueError(f"World.set_link: gbps must be 0 (off) or at least 0.1, got {gbps}.")
        if gbps and not self.link_clocks:
            for _ in range(self.world):
                clock = DeviceBuffer(128)  # its own 128-byte line: ranks never share one
                clock.fill(0)
                self.link_clocks.append(clock)
        for r in range(self.world):
            self._ffi.comm_set_link(self.comm_base + r, self.device, gbps,
                                    self.link_clocks[r].ptr if gbps else 0)
        self.link_gbps = gbps

    def _scale_model(self, flop_per_byte: float) -> None:
        if len(set(self.sms)) != 1:
            raise ValueError(f"World: the scale model needs equal partitions, got {self.sms}.")
        tflops = self.matmul_tflops()
        gbps = real_node_link_gbps(tflops, flop_per_byte)
        self.set_link(gbps)
        self.scale = {"scale_model": True, "sms_per_rank": self.sms[0],
                      "partition_tflops": round(tflops, 1), "link_gbps": round(gbps, 2),
                      "flop_per_byte": flop_per_byte}

    def comm_sms(self, c_on_node: int) -> int:
        """The communication SMs an op asking for `c_on_node` (on a 132-SM GPU) gets on a rank:
        scaled in the scale model (`node_comm_sms`), as asked otherwise."""
        return node_comm_sms(c_on_node, self.sms[0]) if self.scale else int(c_on_node)

    def matmul_tflops(self, m: int = 8192, n: int = 8192, k: int = 2048) -> float:
        """TFLOP/s of one rank's bf16 matmul (pk.matmul's launcher) while every rank runs one at
        once: the emulated rank's compute rate, measured (median of 5 batches of 10)."""
        bufs = [(DeviceBuffer(m * k * 2), DeviceBuffer(k * n * 2), DeviceBuffer(m * n * 2))
                for _ in range(self.world)]
        try:
            for x, w, _ in bufs:
                x.fill(0x3C)  # bf16 0x3C3C: a small finite value
                w.fill(0x3C)

            def all_ranks():
                for r, (x, w, y) in enumerate(bufs):
                    self.launch("matmul", r, {"dtype": DTYPES["bfloat16"], "x": x, "w": w,
                                              "y": y, "m": m, "k": k, "n": n, "y_rows": m,
                                              "y_cols": n, "config": 0, "group_m": 8})

            all_ranks()
            self.synchronize()
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    all_ranks()
                self.synchronize()
                samples.append((time.perf_counter() - start) / 10)
        finally:
            for trio in bufs:
                for b in trio:
                    b.free()
        return 2.0 * m * n * k / float(np.median(samples)) / 1e12

    # -------------------------------------------------------------------------------------
    @property
    def sms(self) -> list[int]:
        return [p.sms for p in self.parts]

    def workspace_ptr(self, rank: int) -> int:
        return self.mappings[rank].ptr

    def signal_ptr(self, rank: int) -> int:
        return self.mappings[rank].ptr + self.signal_offset

    def launch(self, op: str, rank: int, args: dict, *, delay_ns: int = 0,
               num_sms: int | None = None) -> None:
        """Queues op `op` of `rank` on its stream (after a delay kernel when delay_ns > 0).

        `args` are the launcher's fields by the names its visitor gives them (ffi/launch.h
        VisitFields, `_pk_ffi.op_fields()`), buffers as DeviceBuffers or device addresses;
        `rank` (the rank operand of an op with a communicator) is filled in. Raises ValueError
        when the launcher refuses the call (the same message the FFI handler returns).
        """
        part = self.parts[rank]
        if delay_ns > 0:
            self._ffi.emu_delay(part.stream, int(delay_ns))
        fields = {k: (v.ptr if isinstance(v, DeviceBuffer)
                      else float(v) if isinstance(v, (float, np.floating)) else int(v))
                  for k, v in args.items()}
        if self.scale and "num_comm_sms" in fields:  # the node's count, scaled to the partition
            fields["num_comm_sms"] = self.comm_sms(fields["num_comm_sms"])
        entry = _op_table.OPS.get(op)
        if entry is None or entry["comm"]:  # matmul, attention, grouped_matmul take no rank
            fields["rank"] = self.ranks[rank].ptr
        try:
            self._ffi.emu_launch(op, self.comm_base + rank, self.device, part.stream,
                                 int(num_sms if num_sms is not None else part.sms), fields)
        except RuntimeError as e:  # an earlier kernel failed: say what the record holds
            record = self.error_record()
            text = errors.describe(record) if record[0] else "no error recorded"
            raise EmulatorError(f"pk_jax emulator (P={self.world}): launching {op} on rank "
                                f"{rank} failed: {e}; {text}", record) from e

    def call(self, op: str, args: list[dict], *, delays_ns: list[int] | None = None,
             skip: tuple[int, ...] = ()) -> None:
        """Queues one call of `op` on every rank (args[r] for rank r), ranks in `skip` never
        arrive. Launches are queued rank by rank; a rank's delay holds only its own stream."""
        for r in range(self.world):
            if r in skip:
                continue
            self.launch(op, r, args[r], delay_ns=delays_ns[r] if delays_ns else 0)

    def error_record(self) -> tuple[int, ...]:
        if self.record is None:
            return (0,) * errors.RECORD_WORDS
        import ctypes

        return tuple((ctypes.c_int32 * errors.RECORD_WORDS).from_address(self.record.host_ptr))

    def synchronize(self, timeout_s: float | None = None) -> float:
        """Waits for every rank's streams, at most `timeout_s` (default: the world's timeout
        plus 5 s); returns the seconds waited.

        Raises:
            EmulatorError: a kernel failed (the recorded error, or the CUDA error), or a stream
                was still busy at the bound (then the kernels hang despite their timeouts).
        """
        cu = vmm.driver()
        bound = self.timeout_s + 5.0 if timeout_s is None else float(timeout_s)
        start = time.monotonic()
        pending = [s for p in self.parts for s in (p.stream, p.side_stream)]
        while pending:
            still = []
            for s in pending:
                (err,) = cu.cuStreamQuery(cu.CUstream(s))
                if err == cu.CUresult.CUDA_ERROR_NOT_READY:
                    still.append(s)
                elif err != cu.CUresult.CUDA_SUCCESS:
                    self._fail(f"a kernel failed ({err})", start)
            pending = still
            if pending:
                if time.monotonic() - start > bound:
                    self._fail(f"streams still busy after {bound:g} s", start)
                time.sleep(0.0005)
        record = self.error_record()
        if record[0] != 0:
            self._fail("a kernel recorded an error", start)
        return time.monotonic() - start

    def _fail(self, what: str, start: float):
        elapsed = time.monotonic() - start
        record = self.error_record()
        text = errors.describe(record) if record[0] else "no error recorded"
        raise EmulatorError(f"pk_jax emulator (P={self.world}): {what} after {elapsed:.2f} s: "
                            f"{text}", record, elapsed)

    def close(self) -> None:
        """Unregisters the ranks and releases memory, streams and green contexts (best effort
        after a trap, when the process's context is unusable)."""
        if self.closed:
            return
        self.closed = True
        for cid in self.registered:
            self._ffi.comm_unregister(cid, self.device)
        self.registered = []
        cu = vmm.driver()
        for p in self.parts:
            for s in (p.stream, p.side_stream):
                cu.cuStreamSynchronize(cu.CUstream(s))
        for b in self.ranks + self.link_clocks:
            b.free()
        self.link_clocks = []
        for m in self.mappings:
            _quiet(m.unmap)
        for a in self.allocations:
            _quiet(a.release)
        if self.record is not None:
            _quiet(self.record.free)
        destroy_partitions(self.parts)
        self.parts, self.ranks, self.mappings, self.allocations = [], [], [], []
        self.record = None
        _quiet(self._ctx.__exit__, None, None, None)
        _quiet(self._ctx.release)

    def __enter__(self) -> World:  # noqa: PYI034 (typing.Self needs Python 3.11)
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001, S110 -- after a trap releases fail; the process ends
        pass
