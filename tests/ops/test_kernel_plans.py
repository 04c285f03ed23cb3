"""The CUDA skinny kernel's launch planning, in pure Python (no extension, no GPU): resident blocks
per SM from registers and shared memory (the CUDA occupancy rule), the op's split clamp, and the
split count with the least modelled time (eagle3_ops/skinny_model.py, the one model the planner and
benchmarks/static_model.py share; docs/kernels.md §7.5); and the Triton tiled kernel's per-arch
config (a wave at M = 256 on sm_120, no spills; compile only).

The register counts and hot-loop instruction counts are the built cubins' (cuda_backend.SKINNY_REGISTERS,
SKINNY_STEP_INSTRUCTIONS; tests/test_build.py checks them against the extension); on a GPU the
planner asks the CUDA runtime for the occupancy instead (eagle3_cuda::skinny_occupancy, checked
against the table in tests/test_cuda_ops_registration.py on the device)."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import types

import pytest
import torch

from eagle3_ops import cuda_backend as cb
from eagle3_ops import skinny_model as sm

ROOT = Path(__file__).resolve().parents[2]
SM90, SM120 = cb.SM_LIMITS["sm_90"], cb.SM_LIMITS["sm_120"]
H200, PRO6000 = sm.DEVICES["H200"], sm.DEVICES["RTX PRO 6000"]


# ---- resident blocks from registers and shared memory ---------------------------------------------------
@pytest.mark.parametrize("regs,shared,limits,want", [
    (148, 0, SM90, 3),       # 148 x 32 = 4736 -> 4864 per warp -> 3 warps per sub-partition
    (191, 0, SM90, 2),       # 6112 -> 6144 per warp -> 2 per sub-partition -> 8 warps
    (128, 0, SM90, 4),
    (72, 0, SM90, 7),        # 2304 per warp -> 7 per sub-partition -> 28 warps
    (32, 0, SM90, 16),       # thread limit: 2048 / 128
    (32, 0, SM120, 12),      # thread limit: 1536 / 128
    (124, 49152, SM90, 4),   # NT = 8: 4096 per warp -> 4 blocks; 228 KB / (48 + 1) KB -> 4
    (59, 36864, SM90, 6),    # NT = 1: registers allow 8, shared memory 228 / 37 -> 6
    (59, 36864, SM120, 2),   # 100 KB / 37 KB -> 2
    (124, 49152, SM120, 2),  # 100 / 49 -> 2 (registers would allow 3)
])
def test_blocks_per_sm(regs, shared, limits, want):
    assert sm.blocks_per_sm(regs, shared, 128, limits) == want
    assert cb.blocks_per_sm_from_registers(regs, 128, limits, shared) == want


def test_blocks_per_sm_is_monotone_and_bounded():
    for limits in (SM90, SM120):
        for shared in (0, 16384, 49152):
            prev = None
            for regs in range(16, 256):
                b = sm.blocks_per_sm(regs, shared, 128, limits)
                assert 1 <= b <= min(limits.max_blocks, limits.max_threads // 128)
                assert prev is None or b <= prev
                assert b * 4 * math.ceil(regs * 32 / 256) * 256 <= limits.registers
                assert b * (shared + limits.shared_reserved_per_block) <= limits.shared_per_sm or shared == 0
                prev = b


def test_kernel_tables_cover_every_kernel():
    for table in (cb.SKINNY_REGISTERS, cb.SKINNY_STEP_INSTRUCTIONS):
        for arch in ("sm_90a", "sm_120a"):
            assert set(table[arch]) == {(d, *shape) for d in ("bfloat16", "float16") for shape in sm.SKINNY_SHAPES}
    assert all(0 < r <= 255 for t in cb.SKINNY_REGISTERS.values() for r in t.values())
    for nt in (1, 2, 4, 8):  # every token tile has a 64-row block whose ring fits static shared memory
        assert sm.shapes_for(nt)[0] == (nt, 64, sm.STAGES[nt]) and sm.shared_bytes(nt) <= 48 * 1024
    for nt, rows, stages in sm.SKINNY_SHAPES:  # stages - 1 >= 2 steps in flight, a warp per 16 rows
        assert stages >= 3 and rows % 16 == 0
        k = cb.kernel_model("sm_90", (nt, rows, stages), torch.bfloat16)
        assert k.in_flight == (stages - 1) * rows * 64 * 2 == sm.in_flight_bytes(nt, 2, rows, stages)
        assert k.shape == (nt, rows, stages) and k.threads == 2 * rows
    assert cb.kernel_model("sm_90", 8, torch.bfloat16).shape == (8, 64, 3)  # an NT alone: its 64-row block


def test_which_block_shapes_fit_which_arch():
    """The 128-row, 6-stage ring (144 KB) exceeds sm_120's 99 KB per block: 0 resident blocks there,
    so the planner never chooses it; every other shape launches on both archs."""
    for arch in ("sm_90", "sm_120"):
        for shape in sm.SKINNY_SHAPES:
            blocks = cb.table_blocks_per_sm(arch, shape, torch.bfloat16)
            assert (blocks == 0) == (arch == "sm_120" and shape == (8, 128, 6)), (arch, shape, blocks)
    assert sm.blocks_per_sm(80, 147456, 256, SM120) == 0 and sm.blocks_per_sm(80, 147456, 256, SM90) == 1
    k = cb.kernel_model("sm_120", (8, 128, 6), torch.bfloat16)
    assert math.isinf(sm.predict(64, 896, 21504, 1, 8, PRO6000, k).time)
    chosen, _, _ = sm.best_plan(64, 896, 21504, 1, PRO6000, [cb.kernel_model("sm_120", s, torch.bfloat16)
                                                            for s in sm.shapes_for(8)])
    assert chosen.shape != (8, 128, 6)


# ---- the op's clamp, mirrored --------------------------------------------------------------------------
@pytest.mark.parametrize("CH,NC,asked,want", [
    (21504, 1, 7, (7, 3072)),   # 336 steps of 64: 48 each
    (21504, 1, 5, (5, 4352)),   # ceil(21504 / 5) = 4301 -> 68 steps
    (21504, 1, 64, (42, 512)),  # at least 8 steps per split
    (7168, 3, 30, (14, 512)),   # 112 steps / 8; and 3 * 14 <= 64 splits in all
    (7168, 8, 16, (8, 896)),    # at most 64 // 8 = 8 per chunk
    (240, 3, 4, (1, 256)),      # narrower than 8 steps: one split
    (1000, 3, 9, (1, 1024)),    # a chunk width that is no multiple of 64: the last step is partial
])
def test_split_shape_mirrors_the_op(CH, NC, asked, want):
    per_chunk, split_len = sm.split_shape(CH, NC, asked)
    assert (per_chunk, split_len) == want
    assert split_len % 64 == 0 and (per_chunk - 1) * split_len < CH <= per_chunk * split_len
    assert NC * per_chunk <= 64


def test_split_shape_is_idempotent():
    """Asking for the splits the op launched launches them again (the planner returns a count the
    op keeps)."""
    for CH in (256, 512, 1000, 4096, 7168, 21504, 24576):
        for NC in (1, 3, 8):
            for asked in range(1, 50):
                per_chunk, split_len = sm.split_shape(CH, NC, asked)
                assert sm.split_shape(CH, NC, per_chunk) == (per_chunk, split_len)


# ---- the model and the planner ---------------------------------------------------------------------------
def kernel(nt, arch="sm_90"):
    return cb.kernel_model(arch, nt, torch.bfloat16)


def test_a_wave_below_littles_law_streams_at_the_rate_its_bytes_in_flight_allow():
    """One wave, no partials: time = latency + bytes / min(bandwidth, blocks x in-flight / latency)."""
    dev = dataclasses.replace(H200, sms=10, l2_bw=1e15, mma_rate=1e18, clock=1e12)  # only DRAM matters
    k = kernel(1)  # 3 steps x 8 KB in flight per block
    need = dev.read_bw * dev.latency
    for tiles in (1, 4, 20):  # N = 64 * tiles, one split: blocks = tiles
        p = sm.predict(8, 64 * tiles, 4096, 1, 1, dev, k, bpsm=6)
        rate = min(dev.read_bw, tiles * k.in_flight / dev.latency)
        assert p.blocks == tiles and p.S == 1
        assert p.time == pytest.approx(dev.latency + 64 * tiles * 4096 * 2 / rate)
        assert (p.limiter == "bytes in flight") == (tiles * k.in_flight < need and p.time > 1.05 * p.floor)
    # more waves: each pays the fill latency; partials and the reducer appear with S > 1
    p1 = sm.predict(8, 64 * 60, 4096, 1, 1, dev, k, bpsm=6)
    p2 = sm.predict(8, 64 * 61, 4096, 1, 1, dev, k, bpsm=6)
    assert p1.waves == 1 and p2.waves > 1 and p2.losses["fill latency"] == pytest.approx(2 * dev.latency)
    p3 = sm.predict(8, 64 * 20, 4096, 1, 4, dev, k, bpsm=6)
    partials = 4 * 8 * 64 * 20 * 4  # written back to DRAM, read again from L2
    assert p3.S == 4 and p3.losses["split-K partials"] == pytest.approx(partials / dev.read_bw + partials / dev.l2_bw)
    assert p3.losses["reducer"] == dev.l2_latency


def test_norm_costs_the_pre_pass_bytes_and_folding_halves_them():
    k = kernel(2)
    plain = sm.predict(16, 7168, 7168, 3, 2, H200, k)
    norm = sm.predict(16, 7168, 7168, 3, 2, H200, k, norm=True)
    folded = sm.predict(16, 7168, 7168, 3, 2, H200, k, norm=True, folded=True)
    assert norm.losses["norm pre-pass"] == pytest.approx(16 * 21504 * 2 * 2 / H200.read_bw)
    assert folded.losses["norm pre-pass"] == pytest.approx(norm.losses["norm pre-pass"] / 2)
    assert plain.time < folded.time < norm.time


ISSUE_SHAPES = [(7168, 21504), (896, 21504), (4096, 12288)]  # Kimi-K2.5 replicated and TP=8, Llama-3.1-8B


@pytest.mark.parametrize("device", [H200, PRO6000], ids=lambda d: d.name)
@pytest.mark.parametrize("N,KH", ISSUE_SHAPES)
@pytest.mark.parametrize("M", [1, 8, 16, 32, 64])
@pytest.mark.parametrize("NC,norm,folded", [(1, False, False), (3, True, False), (3, True, True)],
                         ids=["plain", "norm", "folded"])
def test_the_plan_minimizes_the_model_and_fills_littles_law(device, N, KH, M, NC, norm, folded):
    """The planner's choice is the least modelled time over the block shapes of M's token tile and
    every split shape the op can launch (fewest splits on a tie), and — no cap of its own — it is
    never limited by bytes in flight when a launchable split count would fill the
    bandwidth-latency product (issue 21 item 3: N = 896 was capped at 224 blocks, ~2.5 MB against
    ~4.3 MB on H200)."""
    CH = KH // NC
    kernels = [kernel(shape, device.arch) for shape in sm.shapes_for(sm.token_groups(M))]
    k, asked, best = sm.best_plan(M, N, CH, NC, device, kernels, norm, folded)
    assert all(sm.best_splits(M, N, CH, NC, device, other, norm, folded)[1].time > best.time * (1 - 1e-9)
               for other in kernels)
    bpsm = tuple(cb.table_blocks_per_sm(device.arch, other.shape, torch.bfloat16) for other in kernels)
    assert cb.skinny_choice(M, N, CH, NC, device, tuple(kernels), bpsm, norm, folded)[:2] == (k, asked)
    shapes = {sm.split_shape(CH, NC, a): a for a in range(sm.max_splits_per_chunk(CH, NC), 0, -1)}
    times = {shape: sm.predict(M, N, CH, NC, a, device, k, norm, folded).time for shape, a in shapes.items()}
    assert best.time == pytest.approx(min(times.values()))
    assert all(t > best.time * (1 - 1e-9) for shape, t in times.items() if shape[0] < best.splits_per_chunk)
    reachable = max(sm.predict(M, N, CH, NC, a, device, k, norm, folded).in_flight for a in shapes.values())
    short = best.in_flight < device.bytes_in_flight_needed <= reachable
    assert not (short and best.limiter == "bytes in flight"), best


def test_the_issues_small_n_shape_is_no_longer_short_of_littles_law():
    """Kimi-K2.5 at TP = 8 (N = 896 rows per rank, K*H = 21504), M = 1 on H200: the old cap of 16
    splits per chunk gave 14 x 16 = 224 blocks; now the planner may use up to the op's 42 and the
    ring keeps 24 KB per block in flight: the first wave holds at least the ~4.3 MB Little's law
    asks for."""
    k = kernel(1)
    asked, p = sm.best_splits(1, 896, 21504, 1, H200, k)
    assert p.in_flight >= H200.bytes_in_flight_needed
    assert p.blocks > 14 * 16 or p.in_flight >= H200.bytes_in_flight_needed


def test_plan_uses_the_device_model_the_occupancy_and_the_kernel_of_its_launch(monkeypatch):
    """cuda_backend.plan passes (NT, dtype) of the launch to skinny_blocks_per_sm, the device's model
    and the variant (norm, folded) to the model, on weight's device (x may be a meta tensor)."""
    asked = []

    def fake_bpsm(device, shape, dtype):
        asked.append((device.type, shape, dtype))
        return 4 if shape[1] == 64 else 2

    monkeypatch.setattr(cb, "skinny_blocks_per_sm", fake_bpsm)
    monkeypatch.setattr(cb, "device_model", lambda device: H200)
    monkeypatch.setattr(cb, "_op_bytes", lambda *a: 0)  # the size query is the extension's (not needed here)
    from eagle3_ops import plans

    x = torch.empty(64, 3 * 7168, dtype=torch.bfloat16, device="meta")
    w = torch.empty(7168, 3 * 7168, dtype=torch.bfloat16, device="meta")
    cn = torch.empty(3, 7168, dtype=torch.bfloat16, device="meta")
    with plans.forced_path("skinny"):
        p = cb.plan(x, w, None, None, None, None)
        pn = cb.plan(x, w, None, None, cn, None)
        pf = cb.plan(x, w, None, None, cn, None, norm_folded=True)
    shapes = sm.shapes_for(8)
    assert asked == [("meta", shape, torch.bfloat16) for shape in shapes] * 3
    ks = tuple(cb.kernel_model("sm_90", shape, torch.bfloat16) for shape in shapes)
    bpsm = (4, 2, 2)
    for got, CH, NC, norm, folded in ((p, 21504, 1, False, False), (pn, 7168, 3, True, False),
                                      (pf, 7168, 3, True, True)):
        k, splits, _ = cb.skinny_choice(64, 7168, CH, NC, H200, ks, bpsm, norm, folded)
        assert got.path == "skinny" and (got.splits, got.block_rows, got.stages) == (splits, k.rows, k.stages)


def test_device_model_of_a_gpu_is_read_off_the_gpu_where_it_can_be():
    """The card's own name, SM count and (reported) peak bandwidth and clock; the design estimates no GPU reports
    from the modelled device its name names, else from the one of its arch with the nearest SM count. An H100
    and an H200 have the same SM count: only the name (or the reported bandwidth) tells them apart."""
    h100 = cb._device_model("NVIDIA H100 80GB HBM3", "sm_90", 132)
    assert h100.read_bw == sm.DEVICES["H100"].read_bw < H200.read_bw and h100.name == "NVIDIA H100 80GB HBM3"
    assert cb._device_model("NVIDIA H200", "sm_90", 132).read_bw == H200.read_bw
    # what the H100 reports (cudaDeviceProp: 2619 MHz x 2 x 5120 bits = 3.35 TB/s): READ_FRACTION of it
    reported = cb._device_model("NVIDIA H100 80GB HBM3", "sm_90", 132, 2 * 2619e6 * 640, 1.98e9)
    assert reported.read_bw == pytest.approx(sm.READ_FRACTION * 3.352e12, rel=1e-3) and reported.clock == 1.98e9
    pcie = cb._device_model("NVIDIA H100 PCIe", "sm_90", 114, 2 * 1593e6 * 640)
    assert pcie.sms == 114 and pcie.read_bw == pytest.approx(sm.READ_FRACTION * 2.04e12, rel=1e-2)
    # an unknown card: its arch's modelled device with the nearest SM count, and its own name said as such
    other = cb._device_model("NVIDIA Some Future GPU", "sm_120", 170)
    assert other.mma_rate == sm.DEVICES["RTX 5090"].mma_rate and "RTX 5090-like sm_120" in other.name
    assert cb._device_model("NVIDIA RTX PRO 6000 Blackwell Server Edition", "sm_120", 188).l2_bw == PRO6000.l2_bw


def test_device_peaks_from_cuda_properties():
    props = types.SimpleNamespace(memory_clock_rate=2619000, memory_bus_width=5120, clock_rate=1980000)
    bw, clock = cb.device_peaks(props)
    assert bw == pytest.approx(3.352e12, rel=1e-3) and clock == 1.98e9



# ---- Triton tiled: at least one wave at M = 256 on sm_120, no spills (compile only, no GPU) ------------
@pytest.mark.parametrize("arch,sms", [(12, 188), (12, 170)])
def test_triton_tiled_grid_fills_a_wave_at_m256_on_sm120(arch, sms):
    from eagle3_ops.triton import draft_fc as tfc

    cfg = tfc.tiled_config(arch, 2)
    programs = math.ceil(256 / cfg["BLOCK_M"]) * math.ceil(7168 / cfg["BLOCK_N"])
    assert programs >= sms, (cfg, programs)
    assert cfg["BLOCK_M"] >= 128  # the weight is still read once per 128 tokens


_TILED_COMPILE = textwrap.dedent('''
    import json, os, re, subprocess, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from eagle3_ops.triton import draft_fc as d

    CUO = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    kernel = d._tiled_kernel
    flags = dict(HAS_ROWS=True, HAS_IN_NORM=True, HAS_CHUNK_NORM=True, HAS_SCALE=True, HAS_BIAS=True,
                 INTERPRETER_BF16=False, INPUT_PRECISION="tf32")
    report = {}
    for cc in (90, 120):
        cfg = d.tiled_config(cc // 10, 2)
        opts = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
        consts = dict(flags, **cfg)
        sig = {n: "constexpr" if n in consts else ("*fp32" if n == "scale_ptr" else "*i64" if n == "rows_ptr" else
                                                   "*bf16" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}
        div = [n for n in kernel.arg_names if n not in consts and (n.endswith("_ptr") or n.startswith("stride")
               or n in ("N", "CH"))]
        src = ASTSource(fn=kernel, signature=sig, attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]]
                                                         for n in div},
                        constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
        ck = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=opts)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(ck.asm["cubin"])
        text = subprocess.run([CUO, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        os.unlink(f.name)
        m = re.search(r"REG:(\\d+) STACK:(\\d+) SHARED:\\d+ LOCAL:(\\d+)", text)
        report[f"sm{cc}"] = dict(zip(("REG", "STACK", "LOCAL"), map(int, m.groups())), shared=ck.metadata.shared)
    print(json.dumps(report))
''')


def _ptxas_choices():
    """Each ptxas Triton may compile our kernels with: its own, and, for sm_120 under SGLang, the CUDA
    toolkit's (FlashInfer, which SGLang imports, sets TRITON_PTXAS_BLACKWELL_PATH to the ptxas on PATH
    when it is CUDA >= 13: flashinfer/triton/__init__.py)."""
    import re
    import shutil

    out = [("triton's own", None)]
    system = shutil.which("ptxas")
    if system:
        v = subprocess.run([system, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release (\d+)\.", v)
        if m and int(m.group(1)) >= 13:
            out.append((f"{system} (what FlashInfer points Triton at)", system))
    return out


@pytest.mark.parametrize("which,ptxas", _ptxas_choices(), ids=lambda x: "system" if x and "/" in str(x) else "triton")
def test_triton_tiled_kernel_does_not_spill_on_sm90_or_sm120(which, ptxas):
    """The tiled kernel with every feature on (rows, both norms, scales, bias), compiled (not
    interpreted) with each arch's config and each ptxas Triton may use: no stack frame, no local
    memory, shared memory within a block's limit. (128 x 128 tiles on sm_120 needed 255 registers and
    an 8-byte stack frame; 128 x 64 with 4 stages, 128 registers and a 24-byte frame under CUDA 13.0's
    ptxas, which a test process inherited from SGLang's import of FlashInfer.)"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    if ptxas is not None:
        env["TRITON_PTXAS_PATH"] = env["TRITON_PTXAS_BLACKWELL_PATH"] = ptxas
    proc = subprocess.run([sys.executable, "-c", _TILED_COMPILE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in report.items():
        assert r["STACK"] == 0 and r["LOCAL"] == 0, (which, name, r)
        assert r["shared"] <= (227 if name == "sm90" else 99) * 1024, (which, name, r)
