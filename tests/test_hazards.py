"""The hazard patches of tests/gpu/hazards (each reverts one fix of issue 10) stay usable: each
still applies to the tree, changes only the extension's sources, and names an emulator test
that exists (the test that `tests/gpu/run_all.sh hazards` expects to fail with the patch
built in, and to pass without it)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PATCHES = sorted((ROOT / "tests" / "gpu" / "hazards").glob("*.patch"))
NAMED = re.compile(r"^Test that must fail with this patch applied: (\S+)::(\w+)$", re.MULTILINE)


def _git_checkout() -> bool:
    return shutil.which("git") is not None and (ROOT / ".git").exists()


def test_there_is_a_patch_per_fixed_hazard():
    assert [p.stem for p in PATCHES] == ["comm_blocks_last", "epoch_before_checks",
                                         "helper_grid_local_sms", "mbar_wait_unbounded"]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_patch_names_an_existing_emulator_test(patch):
    m = NAMED.search(patch.read_text())
    assert m, f"{patch.name}: no 'Test that must fail ...' line"
    path, name = m.groups()
    assert path == "tests/gpu/test_emulator.py"
    assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.MULTILINE), name


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.stem)
def test_patch_applies_to_the_extension_sources(patch):
    files = re.findall(r"^diff --git a/(\S+) b/", patch.read_text(), re.MULTILINE)
    assert files and all(f.startswith(("cuda/", "ffi/")) for f in files), files
    if not _git_checkout():
        pytest.skip("not a git checkout: git apply --check needs one")
    r = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, f"{patch.name} no longer applies; rebase it:\n{r.stderr}"
