"""The CUDA skinny kernel's launch planning, in pure Python (no extension, no GPU): resident blocks
per SM from register counts (the CUDA occupancy rule), the op's split clamp, and the split-K count
that fills whole waves of resident blocks (eagle3_ops/cuda_backend.py; docs/kernels.md §7.5); and the
Triton tiled kernel's per-arch config (a wave at M = 256 on sm_120, no spills; compile only).

The register counts are the built cubins' (cuda_backend.SKINNY_REGISTERS; tests/test_build.py checks
them against `cuobjdump -res-usage` of the extension); on a GPU the planner asks the CUDA runtime
instead (eagle3_cuda::skinny_occupancy, checked against the table in
tests/test_cuda_ops_registration.py on the device)."""
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eagle3_ops import cuda_backend as cb

ROOT = Path(__file__).resolve().parents[2]
SM90, SM120 = cb.SM_LIMITS["sm_90"], cb.SM_LIMITS["sm_120"]


# ---- resident blocks from registers ------------------------------------------------------------------
@pytest.mark.parametrize("regs,limits,want", [
    (148, SM90, 3),   # the issue's example: 148 x 32 = 4736 -> 4864 per warp -> 3 warps per sub-partition
    (191, SM90, 2),   # 6112 -> 6144 per warp -> 2 per sub-partition -> 8 warps
    (128, SM90, 4),   # 4096 per warp -> 4 per sub-partition -> 16 warps
    (72, SM90, 7),    # 2304 per warp -> 7 per sub-partition -> 28 warps
    (255, SM90, 2),   # 8160 -> 8192 per warp
    (32, SM90, 16),   # thread limit: 2048 / 128
    (32, SM120, 12),  # thread limit: 1536 / 128
    (111, SM120, 4),  # 3552 -> 3584 per warp -> 4 per sub-partition
    (214, SM120, 2),
])
def test_blocks_per_sm_from_registers(regs, limits, want):
    assert cb.blocks_per_sm_from_registers(regs, 128, limits) == want


def test_blocks_per_sm_is_monotone_in_registers_and_bounded():
    for limits in (SM90, SM120):
        prev = None
        for regs in range(16, 256):
            b = cb.blocks_per_sm_from_registers(regs, 128, limits)
            assert 1 <= b <= min(limits.max_blocks, limits.max_threads // 128)
            assert prev is None or b <= prev
            # never more warps' registers than the SM has
            assert b * 4 * math.ceil(regs * 32 / 256) * 256 <= limits.registers
            prev = b


def test_register_table_covers_every_variant_and_predicts_occupancy():
    for arch in ("sm_90a", "sm_120a"):
        table = cb.SKINNY_REGISTERS[arch]
        assert set(table) == set(itertools.product(("bfloat16", "float16"), (1, 2, 4, 8), cb.SKINNY_VARIANTS))
        assert all(0 < r <= 255 for r in table.values())
    # the issue's numbers: NT = 8 without norm at 148 registers on sm_90a -> 3 blocks per SM
    assert cb.SKINNY_REGISTERS["sm_90a"][("bfloat16", 8, "plain")] == 148
    assert cb.table_blocks_per_sm("sm_90", 8, "plain", torch.bfloat16) == 3
    assert cb.table_blocks_per_sm("sm_90a", 8, "plain", torch.bfloat16) == 3
    assert cb.table_blocks_per_sm("sm_90", 1, "plain", torch.float16) == 7


# ---- the op's clamp, mirrored --------------------------------------------------------------------------
@pytest.mark.parametrize("CH,NC,asked,want", [
    (21504, 1, 7, (7, 3072)),   # 168 steps of 128: 24 each
    (21504, 1, 5, (5, 4352)),   # ceil(21504 / 5) = 4301 -> 34 steps
    (21504, 1, 64, (42, 512)),  # at least 4 steps per split
    (7168, 3, 30, (14, 512)),   # 56 steps / 4; and 3 * 14 <= 64 splits in all
    (7168, 8, 16, (8, 896)),    # at most 64 // 8 = 8 per chunk
    (240, 3, 4, (1, 256)),      # narrower than 4 steps: one split
])
def test_split_shape_mirrors_the_op(CH, NC, asked, want):
    per_chunk, split_len = cb.skinny_split_shape(CH, NC, asked)
    assert (per_chunk, split_len) == want
    assert split_len % 128 == 0 and (per_chunk - 1) * split_len < CH <= per_chunk * split_len
    assert NC * per_chunk <= 64


def test_split_shape_is_idempotent():
    """Asking for the splits the op launched launches them again (the planner returns a count the
    op keeps)."""
    for CH in (256, 512, 1000, 4096, 7168, 21504, 24576):
        for NC in (1, 3, 8):
            for asked in range(1, 17):
                per_chunk, split_len = cb.skinny_split_shape(CH, NC, asked)
                assert cb.skinny_split_shape(CH, NC, per_chunk) == (per_chunk, split_len)


# ---- split-K from occupancy ----------------------------------------------------------------------------
def waves(M, N, CH, NC, splits, sms, bpsm):
    per_chunk, _ = cb.skinny_split_shape(CH, NC, splits)
    blocks = math.ceil(M / (8 * cb.token_groups(M))) * math.ceil(N / 64) * NC * per_chunk
    return blocks, blocks / (bpsm * sms)


def test_the_issues_example_fills_whole_waves():
    """H200, M = 64, H = N = 7168, K = 3, no norm: NT = 8 at 148 registers -> 3 blocks per SM ->
    396 slots. The old rule (3 blocks per SM assumed resident) asked 4 splits: 448 blocks, 1.13
    waves, a 52-block latency-bound tail. Now: 7 splits, 784 blocks, 1.98 waves."""
    bpsm = cb.table_blocks_per_sm("sm_90", 8, "plain", torch.bfloat16)
    assert bpsm == 3
    s = cb.skinny_splits(64, 7168, 21504, 1, 132, bpsm)
    assert s == 7
    blocks, w = waves(64, 7168, 21504, 1, s, 132, bpsm)
    assert blocks == 784 and 1.95 < w <= 2
    old = min(16, math.ceil(3 * 132 / 112))
    assert old == 4 and cb.skinny_cost(64, 7168, 21504, 1, s, 132, bpsm, False) < 0.7 * cb.skinny_cost(
        64, 7168, 21504, 1, old, 132, bpsm, False)


def test_small_m_keeps_one_wave_at_the_saturating_rate():
    """M <= 8 (NT = 1, 72 registers: 7 blocks per SM): 4 splits = 448 blocks already keep 3+ per SM
    streaming; more splits only add partial traffic, so the planner keeps 4 (the old rule's answer)."""
    bpsm = cb.table_blocks_per_sm("sm_90", 1, "plain", torch.bfloat16)
    assert bpsm == 7
    assert cb.skinny_splits(1, 7168, 21504, 1, 132, bpsm) == 4


SHAPES = [(M, N, KH, NC, norm) for M in (1, 7, 16, 33, 64, 100, 128) for N in (4096, 7168, 1000)
          for KH, NC, norm in ((12288, 1, False), (21504, 1, False), (21504, 3, True), (12288, 1, True))]


@pytest.mark.parametrize("arch,sms", [("sm_90", 132), ("sm_120", 188), ("sm_120", 170)])
@pytest.mark.parametrize("M,N,KH,NC,norm", SHAPES)
def test_chosen_splits_minimize_the_model_and_never_lose_to_the_old_rule(arch, sms, M, N, KH, NC, norm):
    CH = KH // NC
    bpsm = cb.table_blocks_per_sm(arch, cb.token_groups(M), "norm" if norm else "plain", torch.bfloat16)
    s = cb.skinny_splits(M, N, CH, NC, sms, bpsm, norm)
    assert 1 <= s <= cb.MAX_SPLITS_PER_CHUNK

    def cost(k):
        return cb.skinny_cost(M, N, CH, NC, k, sms, bpsm, norm)

    assert all(cost(s) <= cost(k) for k in range(1, cb.MAX_SPLITS_PER_CHUNK + 1))
    # the old rule: enough blocks for 3 per SM, whatever the registers allow
    tiles = math.ceil(M / (8 * cb.token_groups(M))) * math.ceil(N / 64) * NC
    old = min(cb.MAX_SPLITS_PER_CHUNK, math.ceil(cb.BLOCKS_PER_SM * sms / tiles))
    assert cost(s) <= cost(old)
    # fewest splits among the equally good ones
    assert all(cost(k) > cost(s) for k in range(1, s) if cb.skinny_split_shape(CH, NC, k) !=
               cb.skinny_split_shape(CH, NC, s))


def test_cost_model_counts_waves_and_partials():
    """One wave of exactly the saturating count moves the weight once; a tail wave of a few blocks
    costs a whole saturating wave; partials cost S*M*N*4 bytes twice."""
    sms, bpsm = 10, 3
    # 30 weight tiles x 1 split = 30 blocks = one full wave of 30 slots, CH = 512: one 512-long split
    base = cb.skinny_cost(8, 30 * 64, 512, 1, 1, sms, bpsm, False)
    assert base == 30 * 64 * 512 * 2  # the weight, no partials (S = 1, no norm)
    # 31 tiles: a second wave of one block, paid as a saturating wave of 30
    assert cb.skinny_cost(8, 31 * 64, 512, 1, 1, sms, bpsm, False) == 2 * base
    # with a norm the partials are written and read once more even with one split
    assert cb.skinny_cost(8, 30 * 64, 512, 1, 1, sms, bpsm, True) == base + 2 * 8 * 30 * 64 * 4


def test_fewer_resident_blocks_than_saturating_make_every_wave_latency_bound():
    """NT = 8 with norms (191 registers on sm_90a: 2 blocks per SM, 264 slots below the 396 that
    saturate): every wave costs a saturating wave, so the planner fills the waves of 264: H = 7168,
    K = 3 chunks, M = 64: 3 splits per chunk = 1008 blocks = 3.82 waves (the old rule's 2 per chunk:
    672 blocks = 2.55 waves, the third half empty)."""
    bpsm = cb.table_blocks_per_sm("sm_90", 8, "norm", torch.bfloat16)
    assert bpsm == 2
    s = cb.skinny_splits(64, 7168, 7168, 3, 132, bpsm, True)
    blocks, w = waves(64, 7168, 7168, 3, s, 132, bpsm)
    assert (s, blocks) == (3, 1008) and 3.8 < w < 4
    assert cb.skinny_cost(64, 7168, 7168, 3, 3, 132, bpsm, True) < cb.skinny_cost(64, 7168, 7168, 3, 2, 132, bpsm, True)


def test_plan_asks_the_occupancy_of_the_variant_it_launches(monkeypatch):
    """cuda_backend.plan passes (NT, variant, dtype) of the launch to skinny_blocks_per_sm and plans
    with its answer on weight's device (x may be a meta tensor)."""
    asked = []

    def fake_bpsm(device, nt, variant, dtype):
        asked.append((device.type, nt, variant, dtype))
        return 3

    monkeypatch.setattr(cb, "skinny_blocks_per_sm", fake_bpsm)
    monkeypatch.setattr(cb, "sm_count", lambda device: 132)
    monkeypatch.setattr(cb, "_op_bytes", lambda *a: 0)  # the size query is the extension's (not needed here)
    from eagle3_ops import plans

    x = torch.empty(64, 3 * 7168, dtype=torch.bfloat16, device="meta")
    w = torch.empty(7168, 3 * 7168, dtype=torch.bfloat16, device="meta")
    cn = torch.empty(3, 7168, dtype=torch.bfloat16, device="meta")
    with plans.forced_path("skinny"):
        p = cb.plan(x, w, None, None, None, None)
        pn = cb.plan(x, w, None, None, cn, None)
        pf = cb.plan(x, w, None, None, cn, None, norm_folded=True)
    assert asked == [("meta", 8, "plain", torch.bfloat16), ("meta", 8, "norm", torch.bfloat16),
                     ("meta", 8, "folded", torch.bfloat16)]
    assert p.path == "skinny" and p.splits == cb.skinny_splits(64, 7168, 21504, 1, 132, 3)
    assert pn.splits == cb.skinny_splits(64, 7168, 7168, 3, 132, 3, True)
    assert pf.path == "skinny" and pf.splits == pn.splits



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


def test_triton_tiled_kernel_does_not_spill_on_sm90_or_sm120():
    """The tiled kernel with every feature on (rows, both norms, scales, bias), compiled (not
    interpreted) with each arch's config: no stack frame, no local memory, shared memory within a
    block's limit. (128 x 128 tiles on sm_120 needed 255 registers and an 8-byte stack frame.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _TILED_COMPILE], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in report.items():
        assert r["STACK"] == 0 and r["LOCAL"] == 0, (name, r)
        assert r["shared"] <= (227 if name == "sm90" else 99) * 1024, (name, r)
