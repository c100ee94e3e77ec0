"""Stands in for the xprof profiler package, which tokamax 0.0.17 imports at import time
(`from xprof.cli.tools import get_kernel_stats_tool`, in tokamax/_src/benchmarking.py) for its
own benchmarking helpers only. The real wheel is 32 MB with dependencies of its own, too much
to carry to the GPU machine; bench/bench_attention.py puts this folder on sys.path only when
the real xprof is absent, and never calls into it (it times tokamax's attention with its own
loop, not tokamax's profiler-based benchmarking)."""
