"""Optional dependencies: importing a module that needs one names the extra that installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, needed_by: str, extra: str) -> ModuleType:
    """Imports `module`, or raises an ImportError that says how to install it.

    Args:
        module: the dependency to import, e.g. "flax.nnx".
        needed_by: the pk_jax module that needs it, for the message.
        extra: the pk_jax extra that installs it, e.g. "nn".

    Returns:
        The imported module.

    Raises:
        ImportError: `module` is not installed; the message names `pip install "pk_jax[extra]"`.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is None or e.name.split(".")[0] != top:
            raise  # the dependency is there but one of its own imports is broken
        raise ImportError(
            f"{needed_by} needs {top}, which is not installed. Install pk_jax's optional "
            f'dependencies with: pip install "pk_jax[{extra}]" (or pip install {top}).',
            name=top) from e
