"""Names in profiler traces: every public op runs under `jax.named_scope("pk.<op>")`.

XLA records the scope in the metadata (`op_name`) of every instruction the op lowers to, the
kernel's custom call or the reference's collectives alike, so a JAX profiler trace (XProf,
TensorBoard) shows them as `jit(step)/.../pk.all_reduce/...`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


def named(fn: Callable, name: str | None = None) -> Callable:
    """`fn` running under jax.named_scope("pk.<name>") (default: its own name)."""
    import jax

    scope = f"pk.{name or fn.__name__}"

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with jax.named_scope(scope):
            return fn(*args, **kwargs)

    wrapper.__pk_scope__ = scope
    return wrapper
