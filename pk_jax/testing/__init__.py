"""Testing tools for multi-rank kernels on one GPU: the rank emulator.

`World(P)` runs P emulated ranks of one communicator on disjoint SM partitions (green
contexts) of one GPU in this process, over symmetric workspaces laid out as `pk.init` lays them
out, and starts each rank's ops through the same C++ launch functions the FFI handlers call.
`pk_jax.testing.ops` builds calls of pk_jax's cross-rank ops with their numpy references.
`World(P, link_gbps=...)` caps each rank's cross-rank traffic (the link throttle), e.g. at
`real_node_link_gbps(tflops_per_rank)` for a real NVLink node's FLOP/byte ratio.
See the README's "Rank emulator" section.
"""

from pk_jax.testing.emulator import (
    REAL_NODE_FLOP_PER_BYTE,
    DeviceBuffer,
    EmulatorError,
    World,
    max_partitions,
    real_node_link_gbps,
    split_sms,
)

__all__ = ["REAL_NODE_FLOP_PER_BYTE", "DeviceBuffer", "EmulatorError", "World", "max_partitions",
           "real_node_link_gbps", "split_sms"]
