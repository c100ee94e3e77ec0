"""Symmetric memory across processes that share one GPU.

Run by pytest (the `gpu` tests below start the launcher), or directly:

    python -m pk_jax.launch -n 4 --share-gpu tests/gpu/test_runtime_mp.py

Each process (rank) drives GPU 0 through its own CUDA context. For a 1-D mesh over all
processes and, with 4 or more, a 2-D mesh, every rank writes a value naming itself and the
communicator into its own workspace (cuMemsetD32), meets the others at a key-value barrier,
then reads every peer's workspace through its mapping of the peer's memory and checks the
peer's value; signal pads read zero at creation. pk.init with a workspace that cannot fit fails
on every rank with the same message. After each pk.shutdown the process holds exactly the file
descriptors it held before pk.init.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [2, 4, pytest.param(8, marks=pytest.mark.large)])
def test_runtime_processes_share_one_gpu(nproc):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), ROOT) if p)
    out = subprocess.run([sys.executable, "-m", "pk_jax.launch", "-n", str(nproc),
                          "--share-gpu", "--timeout", "240", os.path.abspath(__file__)],
                         capture_output=True, text=True, env=env, timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    for rank in range(nproc):
        assert f"[rank {rank}] runtime_mp OK" in out.stdout, out.stdout[-6000:]


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> None:
    import pk_jax.launch

    pk_jax.launch.initialize()
    import jax
    import numpy as np
    from jax._src.distributed import global_state

    import pk_jax as pk
    from pk_jax import _ffi
    from pk_jax.runtime import errors, state, vmm

    me, n = jax.process_index(), jax.process_count()
    client = global_state.client
    dev = jax.local_devices()[0]
    ordinal = dev.local_hardware_id
    rounds = 0

    def barrier(name: str) -> None:
        client.key_value_set(f"test_runtime_mp/{name}/{me}", "1")
        for p in range(n):
            client.blocking_key_value_get(f"test_runtime_mp/{name}/{p}", 120_000)

    def check(mesh, tag: int) -> None:
        rt = state.runtime()
        assert rt is not None, "pk.init made no communicators on a GPU mesh"
        assert state._hosts == {p: 0 for p in range(n)}, state._hosts
        values = {}
        for axis in mesh.axis_names:
            cid = state.comm_id(axis)
            assert state.axis_on_one_host(axis)
            info = _ffi._pk_ffi.comm_info(cid, ordinal)
            group = rt.group(cid, dev)
            assert info is not None and group is not None
            assert info["world"] == group.world == mesh.shape[axis]
            assert info["rank"] == group.rank_of(dev)
            values[cid] = (info, group)
            with rt.contexts[ordinal]:
                for p in range(group.world):
                    pad = vmm.copy_to_host(info["signal_ptrs"][p], 8 * rt.signal_count)
                    assert pad == bytes(len(pad)), f"peer {p}'s signal pad is not zero"
                vmm.memset_d32(info["workspace_ptrs"][info["rank"]],
                               1000 * (cid + 1) + 10 * me + tag, rt.workspace_bytes // 4)
        barrier(f"written{tag}")
        for cid, (info, group) in values.items():
            with rt.contexts[ordinal]:
                for p, peer in enumerate(group.devices):
                    ptr = info["workspace_ptrs"][p]
                    head = np.frombuffer(vmm.copy_to_host(ptr, 64), np.uint32)
                    tail = np.frombuffer(vmm.copy_to_host(ptr + rt.workspace_bytes - 64, 64),
                                         np.uint32)
                    want = 1000 * (cid + 1) + 10 * peer.process_index + tag
                    assert (head == want).all() and (tail == want).all(), (
                        f"comm {cid}: peer {p} (process {peer.process_index}) shows "
                        f"{head[0]}/{tail[0]}, expected {want}")
        assert errors.read() == (0,) * errors.RECORD_WORDS
        barrier(f"read{tag}")

    meshes = [jax.make_mesh((n,), ("x",))]
    if n >= 4 and n % 2 == 0:
        meshes.append(jax.make_mesh((2, n // 2), ("dp", "tp")))

    start_fds = _fd_count()
    pk.init(meshes[0], workspace_bytes=4 << 20)  # warm-up: the driver opens its own fds once
    check(meshes[0], rounds)
    pk.shutdown()
    base = _fd_count()
    print(f"fds: {start_fds} before any pk.init, {base} after the first shutdown")

    for mesh in meshes + meshes:
        rounds += 1
        pk.init(mesh)
        during = _fd_count()
        check(mesh, rounds)
        pk.shutdown()
        assert _ffi._pk_ffi.comm_count() == 0
        after = _fd_count()
        print(f"round {rounds} mesh {dict(mesh.shape)}: fds {during} during, {after} after")
        assert after == base, f"fd leak: {after} open after shutdown, {base} before"

    try:
        # 512 GiB: inside pk.init's bound (2**40) and beyond any Hopper GPU's memory
        pk.init(meshes[0], workspace_bytes=1 << 39)
        raise AssertionError("a workspace of 512 GiB was accepted")
    except RuntimeError as e:
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in str(e), e
        print(f"too-large workspace refused: {str(e)[:100]}...")
    assert state.runtime() is None and _fd_count() == base
    pk.init(meshes[0])  # the job recovers
    check(meshes[0], 99)
    pk.shutdown()
    assert _fd_count() == base
    print(f"runtime_mp OK: P={n}, {rounds} rounds")


if __name__ == "__main__":
    main()
