"""pytest setup: 8 host devices for the CPU tests, and the only place where tests are skipped."""

import importlib.metadata
import os
import pathlib
import re

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

ALLOW_NO_EXTENSION = "PK_JAX_TEST_WITHOUT_EXTENSION"


def built_extensions(package_dir: pathlib.Path) -> list[pathlib.Path]:
    """Compiled pk_jax modules that exist but are not the package under test: in the installed
    distribution (when the tests import another copy, e.g. the source tree) and under build/."""
    found = []
    try:
        dist = importlib.metadata.distribution("pk_jax")
        for f in dist.files or ():
            if f.name.startswith("_pk_ffi") and f.suffix in (".so", ".pyd"):
                path = pathlib.Path(dist.locate_file(f)).resolve()
                if path.exists() and path.parent != package_dir:
                    found.append(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    found += sorted((package_dir.parent / "build").glob("*/**/_pk_ffi*.so"))
    found += sorted(package_dir.glob("_pk_ffi*.so"))  # there, but it did not import
    return found


def extension_problem(has_cuda: bool, package_dir: pathlib.Path, import_error) -> str:
    """Why this run would test pk_jax without its extension while one is built ("" if not)."""
    if has_cuda or os.environ.get(ALLOW_NO_EXTENSION) == "1":
        return ""
    built = built_extensions(package_dir)
    if not built:
        return ""
    return (
        f"the tests import pk_jax from {package_dir}, which has no working CUDA extension "
        f"({import_error}), but a built one exists: {built[0]}. Run the installed build with "
        "`.venv/bin/pytest tests` (or `make test`) instead of `python -m pytest` from the "
        "repository root, which puts the source tree first; or reinstall (`make setup`). Set "
        f"{ALLOW_NO_EXTENSION}=1 to test the pure-Python package anyway."
    )


# Set by tests/gpu/run_all.sh: a GPU run whose GPU tests would all skip fails instead.
REQUIRE_GPU = "PK_JAX_REQUIRE_GPU"
GPU_REASON = "needs an sm_90 GPU and the pk_jax CUDA extension"
EXT_REASON = "needs the compiled pk_jax extension"


def no_hopper_reason(*, short: bool = False) -> str:
    """Why this run has no sm_90 GPU with the extension ("" when it has one); `short`: the
    first sentence of it."""
    if HAS_HOPPER:
        return ""
    if not pk_jax.HAS_CUDA:
        text = str(pk_jax._ffi.IMPORT_ERROR)
        return text.split(". ")[0] if short else text
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as e:
        return f"JAX finds no GPU ({str(e).splitlines()[0]})"
    kinds = sorted({f"{d.device_kind} (sm_{getattr(d, 'compute_capability', '?')})" for d in gpus})
    return f"the GPUs here are {', '.join(kinds)}, not sm_90"


# PK_JAX_TEST_SHARD=i/n: run only every n-th selected test, starting at the i-th (1-based), so
# that n runs (e.g. lanes of tests/gpu/run_all.sh, or device calls) share one file's tests,
# each test in exactly one of them.
SHARD = "PK_JAX_TEST_SHARD"
_SHARD_DROPPED = pytest.StashKey[int]()


def shard_of(spec: str) -> tuple[int, int]:
    """(i, n) of a shard `spec` "i/n"; a clear error otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m or not 1 <= int(m[1]) <= int(m[2]):
        raise pytest.UsageError(f"pk_jax tests: {SHARD}={spec!r}: expected i/n with 1 <= i <= n, "
                                "e.g. 2/3 for the second of three shards")
    return int(m[1]), int(m[2])


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what will not run
def pytest_collection_modifyitems(config, items):
    spec = os.environ.get(SHARD, "")
    if spec:
        i, n = shard_of(spec)
        dropped = [item for k, item in enumerate(items) if k % n != i - 1]
        items[:] = items[i - 1::n]
        config.hook.pytest_deselected(items=dropped)
        config.stash[_SHARD_DROPPED] = len(dropped)
    skip_gpu = pytest.mark.skip(reason=GPU_REASON)
    skip_ext = pytest.mark.skip(reason=EXT_REASON)
    needing = [i for i in items if ("gpu" in i.keywords and not HAS_HOPPER)
               or ("needs_ext" in i.keywords and not pk_jax.HAS_CUDA)]
    if needing and os.environ.get(REQUIRE_GPU) == "1":
        raise pytest.UsageError(
            f"pk_jax tests: {REQUIRE_GPU}=1, and {len(needing)} of the selected tests (e.g. "
            f"{needing[0].nodeid}) need an sm_90 GPU or the CUDA extension, which this run "
            f"lacks: {no_hopper_reason()}. They would pass by skipping. Run them on a Hopper GPU "
            f"with the extension built, or unset {REQUIRE_GPU}.")
    for item in needing:
        item.add_marker(skip_gpu if "gpu" in item.keywords else skip_ext)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line saying why tests were skipped and deselected, which pytest does not say."""
    stats = terminalreporter.stats
    reasons: dict[str, int] = {}
    for report in stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else "?"
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    parts = []
    if reasons:
        why = "; ".join(f"{n} that {'needs' if n == 1 else 'need'} {r.removeprefix('needs ')}"
                        if r.startswith("needs ") else f"{n}: {r}"
                        for r, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
        here = no_hopper_reason(short=True) if GPU_REASON in reasons or EXT_REASON in reasons else ""
        parts.append(f"{sum(reasons.values())} skipped: {why}" + (f" (here: {here})" if here
                                                                  else ""))
    deselected = stats.get("deselected", [])
    if deselected:
        markexpr, keyword = config.getoption("markexpr", ""), config.getoption("keyword", "")
        large = sum(1 for item in deselected if "large" in getattr(item, "keywords", ()))
        large = large if "not large" in markexpr else 0
        how = " and ".join(f"-{flag} {expr!r}" for flag, expr in (("m", markexpr),
                                                                 ("k", keyword)) if expr)
        why = [(f"{large} marked large (the large parametrisation, deselected by pyproject's "
                "addopts -m 'not large'; -m large runs them)")] if large else []
        sharded = config.stash.get(_SHARD_DROPPED, 0)
        if sharded:
            why.append(f"{sharded} by {SHARD}={os.environ.get(SHARD)}")
        if len(deselected) > large + sharded:
            why.append(f"{len(deselected) - large - sharded} by {how or 'the command line'}")
        parts.append(f"{len(deselected)} deselected: {', '.join(why)}")
    if parts:
        terminalreporter.write_line("pk_jax: " + "; ".join(parts))


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_ext: needs the compiled extension (any platform)")
    problem = extension_problem(pk_jax.HAS_CUDA, pathlib.Path(pk_jax.__file__).resolve().parent,
                                pk_jax._ffi.IMPORT_ERROR)
    if problem:
        raise pytest.UsageError(f"pk_jax tests: {problem}")


@pytest.fixture(autouse=True)
def _fresh_pk_state():
    """Every test starts and ends without a mesh registered with pk_jax."""
    pk_jax.shutdown()
    yield
    pk_jax.shutdown()


@pytest.fixture(autouse=True)
def _workspace_need_without_extension(monkeypatch):
    """Without the extension no kernel runs, but the tests that stand in for the kernels
    (tests/util.py stand_in_kernels and the like) still trace the kernel paths, whose workspace
    need is the extension's (ffi/launch.h WorkspaceNeed through `_ffi.workspace_need`). There
    it reads as 0; the tests of the need itself and of a workspace too small for it are
    `needs_ext`."""
    if not pk_jax.HAS_CUDA:
        monkeypatch.setattr(pk_jax._ffi, "workspace_need", lambda op, world, **sizes: 0)
