"""The build: one source list for setup.py and CMake, and when nvcc is present the extension is
built (a missing extension is a failure) with sm_90a and sm_120a cubins."""
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import eagle3_ops
from eagle3_ops import dispatch

ROOT = Path(__file__).resolve().parent.parent


def _setup_sources():
    """The list setup.py compiles (importing setup.py does not build: it guards setup())."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_eagle3_setup", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.read_sources()


def test_source_list_names_every_source_in_csrc():
    listed = sorted(_setup_sources())
    on_disk = sorted(os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / "csrc" / "*.cu")) +
                     glob.glob(str(ROOT / "csrc" / "*.cpp")) + glob.glob(str(ROOT / "csrc" / "*.cc")))
    assert listed == on_disk


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not installed")
def test_cmake_builds_the_same_source_list(tmp_path):
    out = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path), "-DEAGLE3_OPS_LIST_SOURCES_ONLY=ON"],
                         capture_output=True, text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "eagle3_ops sources:" in ln)
    cmake_sources = sorted(os.path.relpath(p, ROOT) for p in line.split("eagle3_ops sources:")[1].strip().split(";"))
    assert cmake_sources == sorted(_setup_sources())


def _nvcc_expected() -> bool:
    return shutil.which("nvcc") is not None and os.environ.get("EAGLE3_OPS_SKIP_CUDA", "0") != "1"


def _cuobjdump():
    found = shutil.which("cuobjdump")
    if found:
        return found
    import triton

    cand = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(cand) if cand.exists() else None


@pytest.mark.skipif(not _nvcc_expected(), reason="no nvcc on PATH (or EAGLE3_OPS_SKIP_CUDA=1): pure-Python install")
def test_extension_is_built_for_sm90a_and_sm120a():
    ext = dispatch.cuda_extension()
    assert ext is not None, "nvcc is present but eagle3_ops._C was not built/importable"
    assert eagle3_ops.build_info()["compiled_archs"] == ["sm_90a", "sm_120a"]
    tool = _cuobjdump()
    assert tool is not None, "cuobjdump not found (ships with triton)"
    listing = subprocess.run([tool, "--list-elf", ext.__file__], capture_output=True, text=True, check=True).stdout
    archs = set(re.findall(r"\.(sm_\d+a?)\.cubin", listing))
    assert {"sm_90a", "sm_120a"} <= archs, listing
    # every compiled kernel family has both cubins
    for family in ("capture", "fused_add_rmsnorm_capture", "draft_fc"):
        assert f"{family}.sm_90a.cubin" in listing and f"{family}.sm_120a.cubin" in listing
