"""The SASS analyser (tools/sass.py) that tests/test_build.py runs on the built kernels, tested
on synthetic cuobjdump listings (no nvcc, no GPU: runs everywhere): it finds the hot loop, measures
the weight pipeline across the back-edge, and compares hot loops; the build's criteria
(sass.PIPELINE_MIN_STAGES, sass.NORM_LOOP_MAX_RATIO) pass a pipelined loop and FAIL a collapsed
pipeline and a norm loop with the gains back in it — so the build tests can fail."""
import pytest

from tools import sass


def listing(*bodies, arch="sm_90a"):
    """A cuobjdump -sass text of functions (name, [instruction, ...]); addresses 0x10 apart;
    "BRA @N" branches to instruction N of the same function."""
    out = [f"\tcode for {arch}"]
    for name, ins in bodies:
        out.append(f"\t\tFunction : {name}")
        for i, text in enumerate(ins):
            if "@" in text and "BRA" in text:
                head, target = text.rsplit("@", 1)
                text = f"{head}0x{int(target) * 16:x}"
            out.append(f"        /*{i * 16:04x}*/                   {text} ;   /* 0x0000000000000000 */")
    return "\n".join(out) + "\n"


PROLOGUE = ["MOV R1, c[0x0][0x28]",
            "LDGSTS.E.BYPASS.LTC256B.128 [R2], desc[UR4][R4.64]",
            "LDGSTS.E.BYPASS.LTC256B.128 [R2+0x2000], desc[UR4][R6.64]",
            "LDGSTS.E.BYPASS.128 [R3], desc[UR6][R8.64]",
            "LDGDEPBAR",
            "LDGDEPBAR"]
MMAS = ["LDSM.16.M88.4 R20, [R10]", "LDSM.16.M88.4 R24, [R11]",
        "HMMA.16816.F32.BF16 R12, R20, R24, R12", "HMMA.16816.F32.BF16 R16, R20, R26, R16"]
REFILL = ["LDGSTS.E.BYPASS.LTC256B.128 [R2], desc[UR4][R4.64]", "LDGSTS.E.BYPASS.128 [R3], desc[UR6][R8.64]"]


def ring(wait_pending, wait_after_commit=False, extra=()):
    """The skinny kernel's loop shape: wait, barrier, refill, commit, fragments + MMAs, back-edge."""
    head = len(PROLOGUE)
    if wait_after_commit:  # collapsed: the copies just issued are waited for before the MMAs
        body = ["BAR.SYNC.DEFER_BLOCKING 0x0"] + REFILL + ["LDGDEPBAR", f"DEPBAR.LE SB0, 0x{wait_pending:x}"]
    else:
        body = [f"DEPBAR.LE SB0, 0x{wait_pending:x}", "BAR.SYNC.DEFER_BLOCKING 0x0"] + REFILL + ["LDGDEPBAR"]
    body += MMAS + list(extra) + ["VIADD R30, R30, 0x1", "ISETP.GE.AND P0, PT, R30, R31, PT", f"@!P0 BRA @{head}"]
    return PROLOGUE + body + ["EXIT", "BRA @999"]


def only(text):
    (fn,) = sass.parse_sass(text).values()
    return fn


def test_parse_finds_functions_arches_predicates_and_the_hot_loop():
    fns = sass.parse_sass(listing(("k1", ring(2)), ("k2", ["MOV R1, R2", "EXIT"])))
    assert set(fns) == {("sm_90a", "k1"), ("sm_90a", "k2")}
    ins = fns[("sm_90a", "k1")]
    assert ins[-3].pred == "@!P0" and ins[-3].base == "BRA"
    lp = sass.hot_loop(ins)
    assert lp is not None and ins[lp.head].opcode.startswith("DEPBAR") and ins[lp.tail].base == "BRA"
    assert sass.hot_loop(fns[("sm_90a", "k2")]) is None  # no loop, no MMA


def test_the_last_function_of_a_cubin_keeps_its_arch():
    """cuobjdump lists one cubin per arch; the function just before `code for sm_120a` is still an
    sm_90a one (the parser once filed it under the next arch, which swapped two rows of
    cuda_backend.SKINNY_STEP_INSTRUCTIONS between the archs)."""
    text = listing(("k", ring(2)), ("last", ["MOV R1, R2", "EXIT"])) + listing(
        ("k", ring(1)), ("last", ["MOV R1, R3", "MOV R2, R3", "EXIT"]), arch="sm_120a")
    fns = sass.parse_sass(text)
    assert set(fns) == {(a, f) for a in ("sm_90a", "sm_120a") for f in ("k", "last")}
    assert [len(fns[(a, "last")]) for a in ("sm_90a", "sm_120a")] == [2, 3]
    assert fns[("sm_90a", "k")] != fns[("sm_120a", "k")]


@pytest.mark.parametrize("pending,want", [(2, 3), (1, 2)])
def test_a_ring_keeps_its_steps_in_flight_across_the_back_edge(pending, want):
    ins = only(listing(("ring", ring(pending))))
    p = sass.pipeline(ins, sass.hot_loop(ins), sass.WEIGHT_LOAD)
    assert (p.kind, p.in_flight, p.steps_per_iteration, p.loads) == ("ring", want, 1, 1)
    assert sass.weight_stages_in_flight(ins) >= sass.PIPELINE_MIN_STAGES


@pytest.mark.parametrize("listing_body,want", [
    (ring(0), 1),                           # waits for everything but the step it is about to issue
    (ring(0, wait_after_commit=True), 0),   # waits for the copies it just issued: nothing in flight
    (ring(1, wait_after_commit=True), 1),
])
def test_a_collapsed_ring_fails_the_build_criterion(listing_body, want):
    ins = only(listing(("collapsed", listing_body)))
    assert sass.weight_stages_in_flight(ins) == want < sass.PIPELINE_MIN_STAGES


def test_register_pipeline_distance_crosses_the_back_edge_only_when_loads_are_used_next_iteration():
    load = "LDG.E.NA.LTC256B.128.CONSTANT R20, desc[UR6][R2.64]"
    mma = "HMMA.16816.F32.BF16 R12, R20, R24, R12"
    used_now = ["MOV R1, R2", load, "LDG.E.NA.LTC256B.128.CONSTANT R24, desc[UR6][R4.64]", mma,
                "IADD3 R2, R2, 0x40, RZ", "@!P0 BRA @1", "EXIT"]
    # the loads of the next iteration are issued after this iteration's MMA (a double buffer ptxas kept)
    used_next = ["MOV R1, R2", mma, load, "LDG.E.NA.LTC256B.128.CONSTANT R24, desc[UR6][R4.64]",
                 "IADD3 R2, R2, 0x40, RZ", "@!P0 BRA @1", "EXIT"]
    a, b = only(listing(("a", used_now))), only(listing(("b", used_next)))
    pa, pb = (sass.pipeline(x, sass.hot_loop(x), sass.WEIGHT_LOAD) for x in (a, b))
    assert pa.kind == pb.kind == "registers"
    assert pa.in_flight == 0 and pa.stages_in_flight == 0 < sass.PIPELINE_MIN_STAGES
    assert pb.in_flight == 2 and pb.stages_in_flight == 1.0
    assert all(d < 3 for d in pa.distances) and all(d > 2 for d in pb.distances)


def test_norm_loop_ratio_fails_when_the_gains_are_back_in_the_loop():
    plain = only(listing(("plain", ring(2))))
    gains = ["HADD2.F32 R40, -RZ, R20.H0_H0", "FMUL R40, R40, R41", "FMUL R42, R42, R43",
             "F2FP.BF16.F32.PACK_AB R44, R42, R40", "FFMA R50, R40, R40, R50", "FFMA R51, R42, R42, R51"] * 3
    lean = only(listing(("lean", ring(2, extra=["IADD3 R32, R32, 0x1, RZ"]))))
    fat = only(listing(("fat", ring(2, extra=gains))))
    assert sass.hot_loop_ratio(plain, plain) == 1.0
    assert sass.hot_loop_ratio(lean, plain) <= sass.NORM_LOOP_MAX_RATIO
    assert sass.hot_loop_ratio(fat, plain) > sass.NORM_LOOP_MAX_RATIO


def test_never_executed_placeholders_and_nops_are_not_counted():
    base = only(listing(("a", ring(2))))
    padded = only(listing(("b", ring(2, extra=["@!PT LDS RZ, [RZ]"] * 6 + ["NOP"] * 4))))
    assert sass.hot_loop_ratio(padded, base) == 1.0


def test_resource_usage_parse():
    text = ("Resource usage:\n arch = sm_90a\n  Function k1:\n  REG:124 STACK:0 SHARED:49152 LOCAL:0 CONSTANT[0]:0 "
            "TEXTURE:0\n arch = sm_120a\n  Function k1:\n  REG:100 STACK:8 SHARED:0 LOCAL:4 CONSTANT[0]:0\n")
    got = sass.resource_usage(text)
    assert got[("sm_90a", "k1")] == {"REG": 124, "STACK": 0, "SHARED": 49152, "LOCAL": 0}
    assert got[("sm_120a", "k1")]["STACK"] == 8


SKINNY_SYMBOL = "_ZN6eagle38fc_skinny_kernelIN3c108BFloat16ELi1ELi64ELi4EEEvPKT_"


@pytest.mark.parametrize("sass_arch,usage_arch", [("sm_90", "sm_90a"), ("sm_90a", "sm_90a"), ("sm_90a", "sm_90")],
                         ids=["cuobjdump-12.8", "cuobjdump-13", "usage-bare"])
def test_both_cuobjdump_spellings_of_an_arch_give_the_same_kernels(sass_arch, usage_arch):
    """The cuobjdump of triton 3.6 (12.8) prints `code for sm_90` in -sass and `arch = sm_90a` in -res-usage for the
    same 9.0a cubin; a 13.x one prints sm_90a in both. The static model (benchmarks/static_model.py) reads the
    same kernel from either, filed under the base arch the model knows (sm_90)."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("_eagle3_static_model_t", root / "benchmarks" / "static_model.py")
    model = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = model
    spec.loader.exec_module(model)
    code = sass.parse_sass(listing((SKINNY_SYMBOL, ring(2)), arch=sass_arch))
    usage = sass.resource_usage(f"Resource usage:\n arch = {usage_arch}\n  Function {SKINNY_SYMBOL}:\n"
                                f"  REG:59 STACK:0 SHARED:{36 * 1024 + 1024} LOCAL:0 CONSTANT[0]:0\n")
    kernels = model.kernels_from(usage, code)
    assert list(kernels) == ["sm_90"] and list(kernels["sm_90"]) == [(1, 64, 4)]
    k = kernels["sm_90"][(1, 64, 4)]
    assert (k.regs, k.shared, k.stages) == (59, 36 * 1024, 4)
    assert sass.arch_base("sm_120a") == "sm_120" and sass.arch_base("sm_90") == "sm_90"
    with pytest.raises(KeyError, match="no -res-usage entry"):
        sass.resources(usage, "sm_120a", SKINNY_SYMBOL)
