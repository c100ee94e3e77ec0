"""pytest setup: 8 host devices for the CPU tests, and the only place where tests are skipped."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# The GPU tests run the collective kernels on one GPU too (where users get XLA's no-op).
os.environ.setdefault("PK_JAX_SINGLE_DEVICE_KERNELS", "1")

import jax
import pytest

import pk_jax


def _hopper_gpus() -> list:
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return []
    return [d for d in gpus if getattr(d, "compute_capability", "") == "9.0"]


HAS_HOPPER = bool(_hopper_gpus()) and pk_jax.HAS_CUDA


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an sm_90 GPU and the pk_jax CUDA extension")
    skip_ext = pytest.mark.skip(reason="needs the compiled pk_jax extension")
    for item in items:
        if "gpu" in item.keywords and not HAS_HOPPER:
            item.add_marker(skip_gpu)
        if "needs_ext" in item.keywords and not pk_jax.HAS_CUDA:
            item.add_marker(skip_ext)


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_ext: needs the compiled extension (any platform)")


@pytest.fixture(autouse=True)
def _fresh_pk_state():
    """Every test starts and ends without a mesh registered with pk_jax."""
    pk_jax.shutdown()
    yield
    pk_jax.shutdown()
