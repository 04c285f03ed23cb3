"""The build: one source list for setup.py and CMake, and when nvcc is present the extension is
built (a missing extension is a failure) with sm_90a and sm_120a cubins for every kernel family,
registers its torch ops (tests/test_cuda_ops_registration.py checks them), no kernel uses local
memory (no stack frame, no register spills), the skinny kernels' register counts are the ones
cuda_backend plans split-K with, and the skinny weight stream carries the L2 evict-first hint."""
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import eagle3_ops
from eagle3_ops import cuda_backend

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
    ext = cuda_backend.cuda_extension()
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
    assert cuda_backend.ops_registered()


def _resource_usage(tool: str, so: str) -> dict:
    """(arch, kernel symbol) -> {"REG": .., "STACK": .., "LOCAL": ..} from cuobjdump -res-usage."""
    text = subprocess.run([tool, "-res-usage", so], capture_output=True, text=True, check=True).stdout
    usage, arch, fn = {}, None, None
    for line in text.splitlines():
        if m := re.match(r"arch = (\S+)", line):
            arch = m.group(1)
        elif m := re.match(r"\s*Function (\S+):", line):
            fn = m.group(1)
        elif m := re.match(r"\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line):
            usage[(arch, fn)] = dict(zip(("REG", "STACK", "LOCAL"), map(int, m.groups())))
    return usage


needs_extension = pytest.mark.skipif(not _nvcc_expected(),
                                     reason="no nvcc on PATH (or EAGLE3_OPS_SKIP_CUDA=1): pure-Python install")


def _built():
    ext = cuda_backend.cuda_extension()
    tool = _cuobjdump()
    assert ext is not None, "nvcc is present but eagle3_ops._C was not built/importable"
    assert tool is not None, "cuobjdump not found (ships with triton)"
    return ext, tool


@needs_extension
def test_no_kernel_uses_local_memory():
    """Every kernel of the extension, on both archs, runs from registers: STACK:0 and LOCAL:0 in
    `cuobjdump -res-usage` (a spill shows as a stack frame). Covers every family: capture,
    fused_add_rmsnorm_capture (incl. its scalar 32-packs-per-thread variant, which had a 48-56 byte
    frame on sm_90a), draft_fc (skinny up to ~214 registers with NT = 8 and norms, reduce, prepare)."""
    ext, tool = _built()
    usage = _resource_usage(tool, ext.__file__)
    assert {a for a, _ in usage} == {"sm_90a", "sm_120a"}
    families = {fam: sum(fam in fn for _, fn in usage) for fam in
                ("capture_aligned_kernel", "capture_any_kernel", "fused_row_kernel", "fused_two_pass_kernel",
                 "fc_skinny_kernel", "fc_reduce_kernel", "fc_prepare_kernel")}
    assert all(families.values()), families  # the parse found every family
    assert families["fc_skinny_kernel"] == 2 * 24  # {bf16, fp16} x NT {1,2,4,8} x {plain, norm, folded}, per arch
    spilling = {k: v for k, v in usage.items() if v["STACK"] or v["LOCAL"]}
    assert not spilling, spilling


_SKINNY = re.compile(r"fc_skinny_kernelIN3c10(\d+)(BFloat16|Half)ELi(\d)ELi(\d)E")


def _skinny_registers(usage: dict) -> dict:
    table = {}
    for (arch, fn), v in usage.items():
        if m := _SKINNY.search(fn):
            dtype = "bfloat16" if m.group(2) == "BFloat16" else "float16"
            table.setdefault(arch, {})[(dtype, int(m.group(3)), cuda_backend.SKINNY_VARIANTS[int(m.group(4))])] = v["REG"]
    return table


@needs_extension
def test_skinny_register_table_matches_the_built_cubins():
    """cuda_backend.SKINNY_REGISTERS (what split-K planning assumes without a GPU) is exactly what
    ptxas allocated in the built extension. On a mismatch, paste the printed table."""
    ext, tool = _built()
    built = _skinny_registers(_resource_usage(tool, ext.__file__))
    assert built == cuda_backend.SKINNY_REGISTERS, f"regenerate cuda_backend.SKINNY_REGISTERS: {built!r}"
    # and the planning limits cover both archs the build carries
    assert {a.rstrip("a") for a in built} <= set(cuda_backend.SM_LIMITS)


def _sass_functions(tool: str, so: str) -> dict:
    """(arch, kernel symbol) -> SASS text."""
    text = subprocess.run([tool, "-sass", so], capture_output=True, text=True, check=True).stdout
    out, arch, fn, lines = {}, None, None, []
    for line in text.splitlines():
        if m := re.match(r"\s*code for (sm_\d+a?)", line):
            arch = m.group(1)
        elif m := re.match(r"\s*Function : (\S+)", line):
            if fn is not None:
                out[(arch, fn)] = "\n".join(lines)
            fn, lines = m.group(1), []
        elif fn is not None:
            lines.append(line)
    if fn is not None:
        out[(arch, fn)] = "\n".join(lines)
    return out


@needs_extension
def test_skinny_weight_stream_is_evict_first():
    """The skinny kernels' weight loads (`ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4`
    with a `createpolicy.fractional.L2::evict_first` policy) reach the SASS as
    LDG.E.NA.LTC256B.128.CONSTANT through their own memory descriptor: ptxas folds the L2 policy
    into the descriptor (`desc[URx]`), so the weight loads use a descriptor register that no other
    global access of the kernel (x, norm weights, rows, partials, out: the default descriptor) uses.
    Without the hint every access shares the default descriptor."""
    ext, tool = _built()
    sass = {k: v for k, v in _sass_functions(tool, ext.__file__).items() if "fc_skinny_kernel" in k[1]}
    assert len(sass) == 2 * 24 and {a for a, _ in sass} == {"sm_90a", "sm_120a"}  # 24 variants per arch
    for key, text in sass.items():
        weight = re.findall(r"LDG\.E\.NA\.LTC256B\.128\.CONSTANT \S+, desc\[(UR\d+)\]", text)
        other = re.findall(r"(?:LDG|STG)(?!\.E\.NA\.LTC256B)\S* (?:\S+, )?desc\[(UR\d+)\]", text)
        assert len(weight) >= 16, (key, "2 x kUnroll x 2 weight loads (prologue + loop) expected")
        assert other, key
        assert not set(weight) & set(other), (key, set(weight), set(other))


@needs_extension
def test_split_k_reducer_is_a_programmatic_dependent_launch():
    """The reducer waits for the skinny grid with griddepcontrol.wait (SASS ACQBULK) before its first
    global load, every skinny variant lets it be scheduled early (griddepcontrol.launch_dependents:
    SASS PREEXIT), and the host launches it with cudaLaunchAttributeProgrammaticStreamSerialization.
    (Same bits as two plain launches: the wait covers the whole skinny grid and its writes.)"""
    ext, tool = _built()
    sass = _sass_functions(tool, ext.__file__)
    reducers = {k: v for k, v in sass.items() if "fc_reduce_kernel" in k[1]}
    skinny = {k: v for k, v in sass.items() if "fc_skinny_kernel" in k[1]}
    assert len(reducers) == 2 * 4 and len(skinny) == 2 * 24
    for (arch, fn), text in reducers.items():
        wait, load = text.find("ACQBULK"), text.find("LDG")
        assert 0 <= wait < load, (arch, fn)
    assert all("PREEXIT" in text for text in skinny.values())
    src = (ROOT / "csrc" / "draft_fc.cu").read_text()
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src and "cudaLaunchKernelEx" in src
