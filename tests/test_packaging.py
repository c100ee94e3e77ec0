"""What a new user meets before the first op: the README's and docs' Python runs as written,
optional dependencies name their extra, a test run never tests a tree without a built extension by
mistake, the pins agree, and no file points at documents outside the repository."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from conftest import ALLOW_NO_EXTENSION, extension_problem

import pk_jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG_ROOT = pathlib.Path(pk_jax.__file__).resolve().parents[1]


def _python(code: str, *, env: dict | None = None, cwd=None, timeout: int = 300):
    base = dict(os.environ)
    base.pop("XLA_FLAGS", None)  # as a user's shell has it: the snippet must say what it needs
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(PKG_ROOT), base.get("PYTHONPATH"))
                                         if p)
    base.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=base, cwd=cwd, timeout=timeout, check=False)


# ------------------------------------------------------------------------- README and docs


GPU_BLOCK = "# needs a Hopper GPU"  # first line of a block that runs only on one
DOC_FILES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))


def python_blocks(path: str) -> list[str]:
    """The ```python blocks of one Markdown file, dedented."""
    text = (ROOT / path).read_text()
    return [textwrap.dedent(b) for b in re.findall(r"^ *```python\n(.*?)^ *```", text,
                                                    re.MULTILINE | re.DOTALL)]


def doc_python_blocks(*, gpu: bool = False) -> list[tuple[str, int, str]]:
    """(file, index, code) of the README's and docs' Python blocks: those for any machine, or
    (gpu=True) the GPU-only ones."""
    return [(f, i, b) for f in DOC_FILES for i, b in enumerate(python_blocks(f))
            if b.startswith(GPU_BLOCK) == gpu]


def test_readme_has_a_quick_start_for_a_laptop():
    blocks = python_blocks("README.md")
    assert blocks and "xla_force_host_platform_device_count=8" in blocks[0], (
        "the README's quick start must say how to get 8 CPU devices")


def test_the_guides_keep_their_examples():
    # The guides that show code (each once a README section) still do, and run (below).
    for page in ("index", "guides/layers", "guides/meshes", "guides/multi-node",
                 "guides/profiling"):
        assert python_blocks(f"docs/{page}.md"), page
    assert python_blocks("docs/guides/emulator.md")[0].startswith(GPU_BLOCK)


def _ids(blocks):
    return [f"{f}:{i}" for f, i, _ in blocks]


@pytest.mark.parametrize("path,index,code", doc_python_blocks(), ids=_ids(doc_python_blocks()))
def test_doc_python_block_runs_as_written(path, index, code, tmp_path):
    # Each block in a fresh interpreter, from an empty directory, without the tests' XLA_FLAGS.
    out = _python(code, cwd=tmp_path)
    assert out.returncode == 0, f"{path} block {index}:\n{code}\n{out.stdout}\n{out.stderr}"


@pytest.mark.gpu
@pytest.mark.parametrize("path,index,code", doc_python_blocks(gpu=True),
                         ids=_ids(doc_python_blocks(gpu=True)))
def test_doc_gpu_python_block_runs_as_written(path, index, code, tmp_path):
    out = _python(code, cwd=tmp_path)
    assert out.returncode == 0, f"{path} GPU block {index}:\n{code}\n{out.stdout}\n{out.stderr}"


def test_docs_site_lists_every_page_and_finds_every_plot():
    """What mkdocs --strict checks, without mkdocs: every page is in the nav (a page left out
    is only an INFO there), and every plot a page shows is one of bench/results/ (which
    docs/hooks.py adds to the site)."""
    config = (ROOT / "mkdocs.yml").read_text()
    pages = [f.removeprefix("docs/") for f in DOC_FILES if f.startswith("docs/")]
    assert pages and not [p for p in pages if f": {p}\n" not in config], config
    for page in pages:
        for plot in re.findall(r"\]\(results/([^)]+)\)", (ROOT / "docs" / page).read_text()):
            assert (ROOT / "bench" / "results" / plot).is_file(), (page, plot)
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(((?:docs|bench)/[^)#]+)", readme):
        assert (ROOT / target).is_file(), f"README links to {target}, which is not there"


def test_py_typed_is_installed():
    # PEP 561: type checkers read pk_jax's annotations only where py.typed is installed.
    assert (pathlib.Path(pk_jax.__file__).parent / "py.typed").is_file()


# ------------------------------------------------------------------ optional dependencies


@pytest.mark.parametrize("module,dep", [("pk_jax.nn.flax", "flax"),
                                        ("pk_jax.nn.equinox", "equinox")])
def test_missing_optional_dependency_names_the_extra(module, dep):
    code = (f"import sys; sys.modules[{dep!r}] = None\n"
            f"try:\n    import {module}\nexcept ImportError as e:\n    print(repr(e))\n"
            "else:\n    print('imported')")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert 'pip install "pk_jax[nn]"' in out.stdout and f"needs {dep}" in out.stdout, out.stdout


def test_optional_require_reraises_a_broken_dependency(tmp_path, monkeypatch):
    from pk_jax._optional import require

    with pytest.raises(ImportError, match=r'pip install "pk_jax\[nn\]"'):
        require("pk_jax_no_such_module.sub", "pk_jax.test", "nn")
    # A dependency that is installed but misses one of its own imports keeps its own error.
    (tmp_path / "pk_fake_dep.py").write_text("import pk_fake_missing_inner\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="pk_fake_missing_inner") as info:
        require("pk_fake_dep", "pk_jax.test", "nn")
    assert "pk_jax[nn]" not in str(info.value)


# ----------------------------------------------------- tests and the built extension


def _no_installed_distribution(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_a_run_without_the_built_extension_fails_and_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOW_NO_EXTENSION, raising=False)
    # Only the tree below tmp_path counts here, not the pk_jax installed in this environment.
    monkeypatch.setattr(importlib.metadata, "distribution", _no_installed_distribution)
    src = tmp_path / "repo" / "pk_jax"
    src.mkdir(parents=True)
    assert extension_problem(False, src, "no module") == ""  # nothing built: pure Python
    built = tmp_path / "repo" / "build" / "cp312-abi3-linux_x86_64" / "_pk_ffi.abi3.so"
    built.parent.mkdir(parents=True)
    built.write_bytes(b"")
    problem = extension_problem(False, src, "No module named 'pk_jax._pk_ffi'")
    assert str(built) in problem and ".venv/bin/pytest" in problem
    assert ALLOW_NO_EXTENSION in problem
    assert extension_problem(True, src, None) == ""  # the extension imported: fine
    monkeypatch.setenv(ALLOW_NO_EXTENSION, "1")
    assert extension_problem(False, src, "x") == ""


def test_a_module_that_is_there_but_does_not_import_is_reported(tmp_path, monkeypatch):
    monkeypatch.delenv(ALLOW_NO_EXTENSION, raising=False)
    monkeypatch.setattr(importlib.metadata, "distribution", _no_installed_distribution)
    src = tmp_path / "pk_jax"
    src.mkdir()
    (src / "_pk_ffi.abi3.so").write_bytes(b"")
    assert "undefined symbol" in extension_problem(False, src, "undefined symbol: foo")


def test_pytest_from_the_source_tree_with_a_built_extension_fails(tmp_path):
    # A copy of the repository's tests and package with a (fake) built module under build/.
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    for f in ("conftest.py", "util.py"):
        (repo / "tests" / f).write_text((ROOT / "tests" / f).read_text())
    (repo / "tests" / "test_x.py").write_text("def test_x():\n    pass\n")
    shutil.copytree(PKG_ROOT / "pk_jax", repo / "pk_jax",
                    ignore=shutil.ignore_patterns("__pycache__", "_pk_ffi*"))
    (repo / "build" / "x").mkdir(parents=True)
    (repo / "build" / "x" / "_pk_ffi.abi3.so").write_bytes(b"")
    env = dict(os.environ, PYTHONPATH=str(repo))
    env.pop(ALLOW_NO_EXTENSION, None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests"], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "a built one exists" in text, text[-3000:]


def _pytest_in_a_copy(tmp_path, test_code: str, env: dict) -> subprocess.CompletedProcess:
    """pytest over one test file beside a copy of the repository's conftest and package."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    for f in ("conftest.py", "util.py"):
        (repo / "tests" / f).write_text((ROOT / "tests" / f).read_text())
    (repo / "tests" / "test_x.py").write_text(test_code)
    shutil.copytree(PKG_ROOT / "pk_jax", repo / "pk_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(repo), ALLOW_NO_EXTENSION: "1", **env}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


GPU_TEST = "import pytest\n\n\n@pytest.mark.gpu\ndef test_on_the_gpu():\n    pass\n"


def test_gpu_tests_that_would_skip_fail_under_require_gpu(tmp_path):
    from conftest import HAS_HOPPER, REQUIRE_GPU

    quiet = _pytest_in_a_copy(tmp_path / "a", GPU_TEST, {REQUIRE_GPU: "0"})
    strict = _pytest_in_a_copy(tmp_path / "b", GPU_TEST, {REQUIRE_GPU: "1"})
    if HAS_HOPPER:  # the GPU machine: the test runs either way
        assert quiet.returncode == strict.returncode == 0, strict.stdout + strict.stderr
        return
    assert quiet.returncode == 0 and "1 skipped" in quiet.stdout, quiet.stdout + quiet.stderr
    # The closing line says why.
    assert "pk_jax: 1 skipped: 1 that needs an sm_90 GPU" in quiet.stdout, quiet.stdout
    text = strict.stdout + strict.stderr
    assert strict.returncode != 0 and f"{REQUIRE_GPU}=1" in text, text
    assert "would pass by skipping" in text and "test_on_the_gpu" in text, text


def _import_pk_jax_copy(tmp_path, extension: bytes | None) -> str:
    """pk_jax._ffi.IMPORT_ERROR of a copy of the package without (or with a broken) module."""
    shutil.copytree(PKG_ROOT / "pk_jax", tmp_path / "pk_jax",
                    ignore=shutil.ignore_patterns("__pycache__", "_pk_ffi*"))
    if extension is not None:
        (tmp_path / "pk_jax" / "_pk_ffi.abi3.so").write_bytes(extension)
    out = _python("import pk_jax; print(pk_jax.HAS_CUDA, pk_jax._ffi.IMPORT_ERROR)",
                  env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_missing_extension_says_what_is_missing_and_how_to_build_it(tmp_path):
    text = _import_pk_jax_copy(tmp_path, None)
    assert text.startswith("False") and "circular import" not in text, text
    assert "pk_jax._pk_ffi is not installed" in text and "PK_JAX_CUDA=ON" in text, text


def test_a_broken_extension_says_it_does_not_import(tmp_path):
    text = _import_pk_jax_copy(tmp_path, b"not an ELF file")
    assert text.startswith("False") and "circular import" not in text, text
    assert "is there but does not import" in text and "rebuild" in text, text


def test_no_gpu_driver_is_said_with_what_to_do(monkeypatch):
    from pk_jax import _ffi

    monkeypatch.setattr(_ffi, "driver_problem",
                        lambda: "libcuda.so.1: cannot open shared object file")
    with pytest.raises(RuntimeError, match=r"pk_jax.testing.World needs an NVIDIA GPU.*"
                                           r"libcuda.so.1 does not load.*PK_JAX_BACKEND="
                                           r"reference"):
        _ffi.require_driver("pk_jax.testing.World")
    monkeypatch.setattr(_ffi, "driver_problem", lambda: "")
    _ffi.require_driver("pk_jax.testing.World")  # a driver: nothing to say


# ------------------------------------------------------------ pins, references, profiles


def test_makefile_pins_satisfy_the_declared_floor():
    pyproject = (ROOT / "pyproject.toml").read_text()
    makefile = (ROOT / "Makefile").read_text()
    floor = re.search(r'"jax>=([0-9.]+)', pyproject).group(1)
    pinned = re.search(r"^JAX_PIN\s*:?=\s*([0-9.]+)", makefile, re.MULTILINE).group(1)
    minimum = re.search(r"^JAX_MIN\s*:?=\s*([0-9.]+)", makefile, re.MULTILINE).group(1)
    assert minimum == floor, "Makefile's JAX_MIN and pyproject's jax floor differ"
    assert f'"jax>={floor}"' in pyproject.split("[project.optional-dependencies]")[0]

    def v(s):
        return tuple(int(p) for p in s.split("."))

    assert v(pinned) >= v(floor)
    for dep in ("flax", "equinox"):
        low = re.search(rf'"{dep}>=([0-9.]+)', pyproject).group(1)
        pins = re.findall(rf'"{dep}==([0-9.]+)"', makefile)
        assert len(pins) == 2 and all(v(pin) >= v(low) for pin in pins), (dep, pins, low)


@pytest.mark.parametrize("gen,header", [("wgmma_gen.py", "wgmma_ops.cuh"),
                                        ("wgmma_rs_gen.py", "wgmma_rs.cuh"),
                                        ("wgmma_ta_gen.py", "wgmma_ta.cuh")])
def test_generated_wgmma_wrappers_are_their_generators_output(gen, header):
    """The wgmma wrappers are generated ("do not edit"): a shape edited into the header by hand,
    or added to the generator without regenerating, fails here."""
    got = subprocess.run([sys.executable, str(ROOT / "cuda" / gen)], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert got == (ROOT / "cuda" / "include" / "pk" / header).read_text(), (
        f"regenerate: python cuda/{gen} > cuda/include/pk/{header}")


# Files of the other developers that still cite documents kept outside the repository; they
# are named here so that this test holds for everything else meanwhile.
_CITES_OUTSIDE_DOCS_PENDING: set[str] = set()


def test_no_file_refers_to_documents_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=False).stdout.split()
    assert files, "git ls-files listed nothing: run the tests in a git checkout"
    docs = {pathlib.Path(f).name for f in files if f.endswith(".md")}
    bad = []
    for f in files:
        if f in _CITES_OUTSIDE_DOCS_PENDING or not (ROOT / f).is_file():
            continue
        try:
            text = (ROOT / f).read_text()
        except UnicodeDecodeError:
            continue
        for ref in re.findall(r"[A-Za-z0-9_./-]*[A-Za-z0-9_]\.md\b", text):
            if pathlib.Path(ref).name not in docs:
                bad.append(f"{f}: {ref}")
        if re.search(r"\.\./shared\b|/work/[a-z]", text):  # (this line matches neither)
            bad.append(f"{f}: a path outside the repository")
    assert not bad, bad


def test_every_public_op_is_named_in_profiles():
    for name in pk_jax.__all__:
        obj = getattr(pk_jax, name)
        if isinstance(obj, type):  # argument types (pk.SegmentIds), not ops
            continue
        if callable(obj) and getattr(obj, "__module__", "").startswith("pk_jax.ops."):
            assert getattr(obj, "__pk_scope__", None) == f"pk.{name}", name


def test_gpu_scripts_name_only_what_pk_jax_has():
    """The benchmarks and the GPU suite's scripts run only on the GPU machine; a name they take
    from pk_jax that a change removed or renamed would first fail there (bench_overlap.py named
    testing.ops.TILE_128x256 for a day after the op table renamed it). Every `from pk_jax... import
    name` and every `alias.attr` on a module imported from pk_jax must exist here."""
    import ast
    import importlib
    import inspect

    problems = []
    for path in sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("tests/gpu/*.py")]):
        tree = ast.parse(path.read_text())
        assigned = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)
                    and isinstance(n.ctx, ast.Store)}
        modules = {}  # alias -> module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pk_jax"):
                base = importlib.import_module(node.module)
                for a in node.names:
                    if not hasattr(base, a.name):
                        try:
                            value = importlib.import_module(f"{node.module}.{a.name}")
                        except ImportError:
                            problems.append(f"{path.name}: {node.module} has no {a.name}")
                            continue
                    else:
                        value = getattr(base, a.name)
                    if inspect.ismodule(value):
                        modules[a.asname or a.name] = value
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("pk_jax.") and a.asname:
                        modules[a.asname] = importlib.import_module(a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.value.id not in assigned
                    and not hasattr(modules[node.value.id], node.attr)):
                problems.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not problems, problems
