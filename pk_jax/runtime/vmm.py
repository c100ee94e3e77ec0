"""CUDA virtual memory management through cuda-python (`cuda.bindings.driver`).

Physical allocations (`cuMemCreate`, exportable as POSIX file descriptors), mappings of them
into this process's address space (`cuMemAddressReserve` + `cuMemMap` + `cuMemSetAccess` for the
devices that use them), the host-mapped error record, and the primary contexts these calls run
in. cuda-python is imported on first use, so CPU-only installs never load it.
"""

from __future__ import annotations

import ctypes
import threading

_cu = None
_init_lock = threading.Lock()


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


def driver():
    """The `cuda.bindings.driver` module, initialised (cuInit) on first use."""
    global _cu
    with _init_lock:
        if _cu is None:
            try:
                from cuda.bindings import driver as cu
            except ImportError as e:  # pragma: no cover - depends on the install
                raise RuntimeError(
                    "pk_jax: the symmetric-memory runtime needs cuda-python "
                    "(pip install cuda-bindings) to allocate VMM memory; set "
                    "PK_JAX_BACKEND=reference to run without it.") from e
            from pk_jax import _ffi

            _ffi.require_driver("pk_jax's symmetric-memory runtime")  # a clear error, not dlopen's
            _check(cu, "cuInit", cu.cuInit(0))
            _cu = cu
    return _cu


def _check(cu, name: str, result):
    """Unpacks a cuda-python result tuple, raising CudaError on a failure."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, err_name = cu.cuGetErrorName(err)
        _, err_text = cu.cuGetErrorString(err)
        raise CudaError(f"pk_jax: {name} failed: {_text(err_name)} ({_text(err_text)}).")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _text(b) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)


def call(name: str, *args):
    """driver().<name>(*args), checked; returns the call's outputs (None, one value or a tuple)."""
    cu = driver()
    return _check(cu, name, getattr(cu, name)(*args))


def round_up(n: int, multiple: int) -> int:
    return -(-int(n) // int(multiple)) * int(multiple)


class Context:
    """The retained primary context of one CUDA device ordinal; `with ctx:` makes it current."""

    def __init__(self, ordinal: int):
        self.ordinal = int(ordinal)
        self.device = call("cuDeviceGet", self.ordinal)
        self.ctx = call("cuDevicePrimaryCtxRetain", self.device)
        self._released = False

    def __enter__(self) -> Context:  # noqa: PYI034 (typing.Self needs Python 3.11)
        call("cuCtxPushCurrent", self.ctx)
        return self

    def __exit__(self, *exc) -> None:
        call("cuCtxPopCurrent")

    def synchronize(self) -> None:
        with self:
            call("cuCtxSynchronize")

    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        with self:
            free, total = call("cuMemGetInfo")
        return int(free), int(total)

    def release(self) -> None:
        if not self._released:
            self._released = True
            call("cuDevicePrimaryCtxRelease", self.device)


def _prop(ordinal: int):
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = int(ordinal)
    prop.requestedHandleTypes = (
        cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
    return prop


def granularity(ordinal: int) -> int:
    """The recommended VMM allocation granularity of device `ordinal` (2 MiB on Hopper)."""
    cu = driver()
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(call("cuMemGetAllocationGranularity", _prop(ordinal), flag))


class Allocation:
    """Physical device memory: created here (`create`) or imported from a peer (`import_fd`).

    Release it only after every mapping of it is unmapped.
    """

    def __init__(self, handle, size: int, ordinal: int | None):
        self.handle = handle
        self.size = int(size)
        self.ordinal = ordinal  # the owning device, when created here
        self._released = False

    @classmethod
    def create(cls, ordinal: int, size: int) -> Allocation:
        """`size` bytes (a multiple of the granularity) on device `ordinal`."""
        handle = call("cuMemCreate", int(size), _prop(ordinal), 0)
        return cls(handle, size, ordinal)

    @classmethod
    def import_fd(cls, fd: int, size: int) -> Allocation:
        """The allocation a peer exported as `fd` (the caller still owns and closes `fd`)."""
        cu = driver()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        handle = call("cuMemImportFromShareableHandle", int(fd), kind)
        return cls(handle, size, None)

    def export_fd(self) -> int:
        """A new file descriptor for this allocation; the caller closes it."""
        cu = driver()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(call("cuMemExportToShareableHandle", self.handle, kind, 0))

    def release(self) -> None:
        if not self._released:
            self._released = True
            call("cuMemRelease", self.handle)


class Mapping:
    """An allocation mapped at a reserved address of this process, accessible to `ordinals`."""

    def __init__(self, allocation: Allocation, ordinals: list[int], alignment: int = 0):
        cu = driver()
        self.size = allocation.size
        self.ptr = int(call("cuMemAddressReserve", self.size, int(alignment), 0, 0))
        self._mapped = False
        try:
            call("cuMemMap", self.ptr, self.size, 0, allocation.handle, 0)
            self._mapped = True
            descs = []
            for ordinal in sorted(set(ordinals)):
                desc = cu.CUmemAccessDesc()
                desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                desc.location.id = int(ordinal)
                desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                descs.append(desc)
            call("cuMemSetAccess", self.ptr, self.size, descs, len(descs))
        except BaseException:
            self.unmap()
            raise

    def unmap(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            try:
                if self._mapped:
                    call("cuMemUnmap", ptr, self.size)
            finally:
                call("cuMemAddressFree", ptr, self.size)


class HostRecord:
    """Zeroed pinned host memory mapped into every device (DEVICEMAP | PORTABLE).

    `host_ptr` is for the host, `device_ptr` for kernels (the same address under UVA).
    """

    def __init__(self, nbytes: int):
        cu = driver()
        flags = cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE
        self.nbytes = int(nbytes)
        self.host_ptr = int(call("cuMemHostAlloc", self.nbytes, flags))
        ctypes.memset(self.host_ptr, 0, self.nbytes)
        try:
            self.device_ptr = int(call("cuMemHostGetDevicePointer", self.host_ptr, 0))
        except BaseException:
            self.free()
            raise

    def free(self) -> None:
        if self.host_ptr:
            ptr, self.host_ptr = self.host_ptr, 0
            call("cuMemFreeHost", ptr)


def memset_d32(ptr: int, value: int, count: int) -> None:
    """Sets `count` uint32 words at device address `ptr` (current context) and waits."""
    call("cuMemsetD32", int(ptr), int(value) & 0xFFFFFFFF, int(count))
    call("cuCtxSynchronize")


def memset_d8(ptr: int, value: int, count: int) -> None:
    call("cuMemsetD8", int(ptr), int(value) & 0xFF, int(count))
    call("cuCtxSynchronize")


def copy_to_host(ptr: int, nbytes: int) -> bytes:
    """`nbytes` bytes from device address `ptr` (current context)."""
    buf = ctypes.create_string_buffer(int(nbytes))
    call("cuMemcpyDtoH", ctypes.addressof(buf), int(ptr), int(nbytes))
    return buf.raw
