"""Stand-in for xprof's kernel statistics tool (see xprof/__init__.py). tokamax calls it only
from its profiler-based timing (`tokamax.benchmark(..., method="xprof")`), which the benchmark
does not use."""

from __future__ import annotations


def compute_kernel_stats(*args, **kwargs):
    """Raises: the real xprof is not installed; this module only lets tokamax import."""
    del args, kwargs
    raise NotImplementedError("xprof is not installed: bench/peers_stub/xprof stands in for it "
                              "so that tokamax imports; its profiler-based timing is not "
                              "available.")
