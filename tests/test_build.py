"""The build: one source list for setup.py and CMake, a metadata step that other installed
distributions cannot break (make install builds while SGLang is being installed), and when nvcc is present the
extension is built (a missing extension is a failure) with a cubin of every arch asked for (TORCH_CUDA_ARCH_LIST; by
default sm_90a and sm_120a; the device check asks for its own card's only) for every kernel family,
registers its torch ops (tests/test_cuda_ops_registration.py checks them), no kernel uses local
memory (no stack frame, no register spills), the skinny kernels' registers, shared memory and hot-loop
instruction counts are the ones cuda_backend plans split-K with, the skinny weight stream carries
the L2 evict-first hint, and — read from the SASS of every skinny kernel on both archs — the weight
pipeline survives ptxas (at least two ring steps in flight across the hot loop's back-edge) and
the norm variants run the plain variant's hot loop (within 1.25x of its instructions per step).
The SASS analyser itself (tools/sass.py) is tested on synthetic listings in
tests/test_sass_analysis.py, where a collapsed pipeline and a fat norm loop fail these checks."""
import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import eagle3_ops
from eagle3_ops import cuda_backend, skinny_model
from tools import sass

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


def test_metadata_step_ignores_other_distributions_writers(tmp_path):
    """`make install` builds this package while uv installs SGLang into the same environment, and
    setuptools imports every distribution's `egg_info.writers` entry point in the metadata step; a
    half-installed one (CI: `kernels` before `kernels_data`) failed the build. The step pip runs
    (PEP 517 prepare_metadata_for_build_editable) must succeed beside a writer that cannot import."""
    site = tmp_path / "site"
    info = site / "half_installed-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: half-installed\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[egg_info.writers]\nhalf.lock = half_installed_writer:write\n")
    out = tmp_path / "metadata"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site), EAGLE3_OPS_SKIP_CUDA="1")
    hook = f"from setuptools import build_meta; print(build_meta.prepare_metadata_for_build_editable({str(out)!r}))"
    run = subprocess.run([sys.executable, "-c", hook], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    dist_info = out / run.stdout.strip().splitlines()[-1]
    # the package's own metadata is all there: the SGLang plugin entry point and the console script
    entry_points = (dist_info / "entry_points.txt").read_text()
    assert "eagle3_ops.sglang.plugin:register" in entry_points and "eagle3-ops" in entry_points


def asked_archs():
    """The archs the build was asked for, as the build spells them (setup.py: TORCH_CUDA_ARCH_LIST, by default
    9.0a;12.0a): ["sm_90a", "sm_120a"]."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_eagle3_setup_archs", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.arch_macro(os.environ.get("TORCH_CUDA_ARCH_LIST", mod.DEFAULT_ARCHS)).split(",")


def _bases(archs) -> set:
    """Archs by their base (cuobjdump spells one cubin sm_90 in -sass, sm_90a elsewhere: sass.arch_base)."""
    return {sass.arch_base(a) for a in archs}


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
def test_extension_is_built_for_the_archs_asked_for():
    ext = cuda_backend.cuda_extension()
    assert ext is not None, "nvcc is present but eagle3_ops._C was not built/importable"
    asked = asked_archs()
    assert eagle3_ops.build_info()["compiled_archs"] == asked
    tool = _cuobjdump()
    assert tool is not None, "cuobjdump not found (ships with triton)"
    listing = subprocess.run([tool, "--list-elf", ext.__file__], capture_output=True, text=True, check=True).stdout
    cubins = re.findall(r"(\w+)\.(sm_\d+a?)\.cubin", listing)  # cuobjdump 12.8 lists sm_90 for a 9.0a cubin
    assert _bases(a for _, a in cubins) >= _bases(asked), listing
    # every compiled kernel family has a cubin of every arch asked for
    for family in ("capture", "fused_add_rmsnorm_capture", "draft_fc"):
        assert _bases(a for f, a in cubins if f == family) >= _bases(asked), (family, listing)
    assert cuda_backend.ops_registered()


def _resource_usage(tool: str, so: str) -> dict:
    """(arch, kernel symbol) -> {"REG", "STACK", "SHARED", "LOCAL"} from cuobjdump -res-usage."""
    return sass.resource_usage(subprocess.run([tool, "-res-usage", so], capture_output=True, text=True,
                                              check=True).stdout)


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
    assert _bases(a for a, _ in usage) == _bases(asked_archs())
    families = {fam: sum(fam in fn for _, fn in usage) for fam in
                ("capture_aligned_kernel", "capture_any_kernel", "fused_row_kernel", "fused_two_pass_kernel",
                 "fc_skinny_kernel", "fc_norm_prepass_kernel", "fc_reduce_kernel", "fc_prepare_kernel")}
    assert all(families.values()), families  # the parse found every family
    # {bf16, fp16} x every block shape, per arch: one hot loop for every variant
    assert families["fc_skinny_kernel"] == 2 * len(asked_archs()) * len(skinny_model.SKINNY_SHAPES)
    spilling = {k: v for k, v in usage.items() if v["STACK"] or v["LOCAL"]}
    assert not spilling, spilling


_SKINNY = re.compile(r"fc_skinny_kernelIN3c10(\d+)(BFloat16|Half)ELi(\d+)ELi(\d+)ELi(\d+)E(.*)")


def _skinny_key(fn: str):
    """(dtype, NT, rows, stages, the rest of the symbol: further template arguments, if any) of a
    skinny kernel."""
    m = _SKINNY.search(fn)
    if not m:
        return None
    return ("bfloat16" if m.group(2) == "BFloat16" else "float16", int(m.group(3)), int(m.group(4)), int(m.group(5)),
            m.group(6))


def _spelled(arch: str) -> str:
    """The arch asked for (and the tables' key) of a cubin cuobjdump lists as ``arch`` (sm_90 or sm_90a)."""
    return next(a for a in asked_archs() if sass.arch_base(a) == sass.arch_base(arch))


def _asked_rows(table: dict) -> dict:
    """A per-arch table of cuda_backend (keyed sm_90a / sm_120a) restricted to the archs asked for."""
    return {a: table[a] for a in asked_archs()}


def _skinny_table(usage: dict, field: str) -> dict:
    table = {}
    for (arch, fn), v in usage.items():
        if key := _skinny_key(fn):
            table.setdefault(_spelled(arch), {})[key[:4]] = v[field]
    return table


@needs_extension
def test_skinny_resource_tables_match_the_built_cubins():
    """cuda_backend.SKINNY_REGISTERS (what split-K planning assumes without a GPU) is exactly what
    ptxas allocated in the built extension, the kernels built are skinny_model.SKINNY_SHAPES, and
    the ring is what skinny_model.shared_bytes says: static shared memory up to 48 KB, beyond it
    none static (the launch passes it as dynamic shared memory): the numbers that decide the
    resident blocks. On a mismatch, paste the printed table."""
    ext, tool = _built()
    usage = _resource_usage(tool, ext.__file__)
    built = _skinny_table(usage, "REG")
    assert built == _asked_rows(cuda_backend.SKINNY_REGISTERS), f"regenerate cuda_backend.SKINNY_REGISTERS: {built!r}"
    shared = _skinny_table(usage, "SHARED")
    for arch, table in shared.items():
        assert {key[1:] for key in table} == set(skinny_model.SKINNY_SHAPES), (arch, sorted(table))
        reserved = cuda_backend.SM_LIMITS[sass.arch_base(arch)].shared_reserved_per_block  # cuobjdump counts it in
        for (dtype, nt, rows, stages), nbytes in table.items():
            ring = skinny_model.shared_bytes(nt, rows, stages)
            static = ring if ring <= skinny_model.STATIC_SHARED_LIMIT else 0
            assert nbytes - reserved == static, (arch, dtype, nt, rows, stages, nbytes)
    # the dynamic rings are launched with their size and the opt-in attribute
    src = (ROOT / "csrc" / "draft_fc.cu").read_text()
    assert "cudaFuncAttributeMaxDynamicSharedMemorySize" in src and "extern __shared__" in src
    # and the planning limits cover both archs the build carries
    assert _bases(built) <= set(cuda_backend.SM_LIMITS)


def _sass_functions(tool: str, so: str) -> dict:
    """(arch, kernel symbol) -> [sass.Instr]."""
    return sass.parse_sass(subprocess.run([tool, "-sass", so], capture_output=True, text=True, check=True).stdout)


@pytest.fixture(scope="module")
def built_sass():
    if not _nvcc_expected():
        pytest.skip("no nvcc on PATH (or EAGLE3_OPS_SKIP_CUDA=1): pure-Python install")
    ext, tool = _built()
    return _sass_functions(tool, ext.__file__)


def _skinny_sass(built_sass) -> dict:
    sk = {k: v for k, v in built_sass.items() if "fc_skinny_kernel" in k[1]}
    # {bf16, fp16} x every block shape, per arch
    assert len(sk) == 2 * len(asked_archs()) * len(skinny_model.SKINNY_SHAPES)
    assert _bases(a for a, _ in sk) == _bases(asked_archs())
    return sk


def _text(ins) -> str:
    return "\n".join(f"{x.pred} {x.opcode} {x.operands}" for x in ins)


@needs_extension
def test_skinny_weight_stream_is_evict_first(built_sass):
    """The skinny kernels' weight copies (`cp.async.cg.shared.global.L2::cache_hint.L2::256B` with a
    `createpolicy.fractional.L2::evict_first` policy) reach the SASS as LDGSTS.E.BYPASS.LTC256B.128
    through their own memory descriptor: ptxas folds the L2 policy into the descriptor
    (`desc[URx]`), so the weight copies use a descriptor register that no other global access of
    the kernel uses (the x copies carry the evict-last policy: another descriptor; rows, partials,
    out: the default one). Without the hint every access shares the default descriptor.
    Read from the copies with a register shared address (`[Rn]`, `[Rn+imm]`: the prologue's, and
    the sm_90a loop's). In its uniform-offset form (`[Rn+URm]`, the sm_120a hot loop) LDGSTS has
    no separately decoded descriptor field (cuobjdump prints `desc[UR1]` for either policy, with or
    without a hint, checked on a small kernel), so the hint there cannot be read from the SASS."""
    for key, ins in _skinny_sass(built_sass).items():
        text = _text(ins)
        weight = re.findall(r"LDGSTS\.E\.BYPASS\.LTC256B\.128 \[R\d+(?:\+0x[0-9a-f]+)?\], desc\[(UR\d+)\]", text)
        x_copies = re.findall(r"LDGSTS\.E\.BYPASS\.128 \[R\d+(?:\+0x[0-9a-f]+)?\], desc\[(UR\d+)\]", text)
        other = re.findall(r"(?:LDG|STG)(?!STS)\S* (?:\S+, )?desc\[(UR\d+)\]", text)
        assert len(weight) >= 4 and x_copies, (key, "weight and x copies expected (prologue + loop)")
        assert not set(weight) & (set(other) | set(x_copies)), (key, set(weight), set(other), set(x_copies))


@needs_extension
def test_skinny_weight_pipeline_survives_ptxas(built_sass):
    """Issue 21 item 1, read from the SASS per kernel and arch: the hot loop (the one with the MMAs)
    refills the shared-memory ring with LDGSTS weight copies and, when it jumps back, still has
    stages - 1 >= 2 steps of weight copies in flight (cp.async.wait_group stages - 2 + the step it
    just committed: `DEPBAR.LE SB0, n` + the LDGDEPBAR after it), for every block shape. A compiler
    or code change that waits for the copies in the iteration that issues them measures 0 here and
    fails."""
    for (arch, fn), ins in _skinny_sass(built_sass).items():
        _, nt, rows, stages, _ = _skinny_key(fn)
        lp = sass.hot_loop(ins)
        assert lp is not None, (arch, fn, "no loop with MMAs")
        p = sass.pipeline(ins, lp, sass.WEIGHT_LOAD)
        assert p.kind == "ring" and p.loads >= 4, (arch, fn, p)
        assert p.stages_in_flight >= sass.PIPELINE_MIN_STAGES, (arch, fn, p)
        assert p.stages_in_flight == stages - 1, (arch, fn, p)  # the model plans with this


@needs_extension
def test_norm_variants_run_the_plain_hot_loop(built_sass):
    """Issue 21 item 2: the norm statistics and x*g are computed by the pre-pass
    (fc_norm_prepass_kernel: no MMA, no weight load), so every skinny launch — plain, norm, folded —
    runs one fc_skinny_kernel<T, NT, rows, stages> per (dtype, block shape): every skinny
    instantiation of a (dtype, block shape) has a hot loop within 1.25x of the plain one's instructions per step
    (today there is exactly one, so the ratio is 1; a variant that brings work back into the loop fails here), and the
    hot loop's instruction counts are the ones the planner uses (cuda_backend.SKINNY_STEP_INSTRUCTIONS)."""
    sk = _skinny_sass(built_sass)
    by_shape = {}
    for (arch, fn), ins in sk.items():
        *key, rest = _skinny_key(fn)
        by_shape.setdefault((arch, *key), []).append((rest, ins))
    counts = {}
    for (arch, *key), kernels in by_shape.items():
        plain = kernels[0][1]
        for _, ins in kernels:
            assert sass.hot_loop_ratio(ins, plain) <= sass.NORM_LOOP_MAX_RATIO, (arch, *key)
        counts.setdefault(_spelled(arch), {})[tuple(key)] = sass.hot_loop_instructions_per_step(plain,
                                                                                            sass.hot_loop(plain))
    assert counts == _asked_rows(cuda_backend.SKINNY_STEP_INSTRUCTIONS), \
        f"regenerate SKINNY_STEP_INSTRUCTIONS: {counts!r}"
    prepass = {k: v for k, v in built_sass.items() if "fc_norm_prepass_kernel" in k[1]}
    assert len(prepass) == 4 * len(asked_archs())  # {bf16, fp16} x {writes x*g, statistics only}, per arch
    for key, ins in prepass.items():
        assert sass.count(ins, "HMMA") == 0 and not any(re.search(sass.WEIGHT_LOAD, x.opcode) for x in ins), key


@needs_extension
def test_draft_fc_kernels_are_chained_by_programmatic_dependent_launch(built_sass):
    """PDL, read from the SASS: the reducer waits (griddepcontrol.wait = ACQBULK) before its first
    global load; the skinny kernel issues its first weight copies BEFORE its wait (they overlap the
    norm pre-pass) and its first x copy after it, and lets the reducer be scheduled early
    (griddepcontrol.launch_dependents = PREEXIT); the pre-pass triggers the skinny launch before
    any global access. The host launches with cudaLaunchAttributeProgrammaticStreamSerialization.
    (Same bits as plain launches: each wait covers the whole previous grid and its writes.)"""
    reducers = {k: v for k, v in built_sass.items() if "fc_reduce_kernel" in k[1]}
    assert len(reducers) == 4 * len(asked_archs())
    for key, ins in reducers.items():
        ops = [x.base for x in ins]
        assert "ACQBULK" in ops and ops.index("ACQBULK") < ops.index("LDG"), key
    for key, ins in _skinny_sass(built_sass).items():
        ops = [x.opcode for x in ins]
        wait = next(i for i, o in enumerate(ops) if o.startswith("ACQBULK"))
        first_weight = next(i for i, o in enumerate(ops) if re.search(sass.WEIGHT_LOAD, o))
        first_x = next(i for i, o in enumerate(ops) if o.startswith("LDGSTS") and "LTC256B" not in o)
        assert first_weight < wait < first_x, key
        assert any(o.startswith("PREEXIT") for o in ops), key
    for key, ins in built_sass.items():
        if "fc_norm_prepass_kernel" in key[1]:
            ops = [x.base for x in ins]
            assert ops.index("PREEXIT") < min(ops.index(o) for o in ("LDG", "STG") if o in ops), key
    src = (ROOT / "csrc" / "draft_fc.cu").read_text()
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in src and "cudaLaunchKernelEx" in src


@needs_extension
def test_kernels_md_prediction_table_is_the_static_model_of_the_built_cubins(built_sass):
    """docs/kernels.md §12's prediction table is what benchmarks/static_model.py computes from the
    built cubins and the planner (regenerate it with --write-docs after a kernel change), and the
    planner's own tables plan the same splits as the cubins do."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_eagle3_static_model", ROOT / "benchmarks" / "static_model.py")
    model = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = model  # (its dataclasses look their module up)
    spec.loader.exec_module(model)
    ext, tool = _built()
    rows = model.predict_all(model.kernels_from(_resource_usage(tool, ext.__file__), built_sass))
    modelled = {model.skinny_model.DEVICES[d].arch for d in model.DEVICES}
    text = model.DOCS.read_text()
    if _bases(asked_archs()) >= modelled:  # every arch of the table built: the table is exactly the model's
        assert {r.device for r in rows} == set(model.DEVICES)
        assert model.replace_docs(text, model.docs_block(rows)) == text, \
            "docs/kernels.md's prediction table is stale: python benchmarks/static_model.py --write-docs"
    else:  # a build for some archs (the device check builds its card's only): their rows, as the table has them
        assert rows and {model.skinny_model.DEVICES[r.device].arch for r in rows} == _bases(asked_archs()) & modelled
        for line in model.markdown(rows).splitlines()[2:]:
            assert line in text, f"docs/kernels.md's prediction table lacks or differs in: {line}"
    assert all(r.planner_agrees for r in rows), [r for r in rows if not r.planner_agrees][:3]
