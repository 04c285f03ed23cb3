"""torch.library.opcheck on every op (schema, fake impl, aliasing, autograd registration, AOT
dispatch) and torch.compile(fullgraph=True) over the ops, on CPU."""
import pytest
import torch

import eagle3_ops


def _capture_samples():
    gen = torch.Generator().manual_seed(0)
    for T, H, K, with_res in ((1, 64, 1, True), (7, 64, 3, False), (33, 128, 2, True)):
        h = torch.randn(T, H, generator=gen)
        r = torch.randn(T, H, generator=gen) if with_res else None
        yield (h, r, torch.randn(T + 2, K * H, generator=gen), K - 1)


def _fused_samples():
    gen = torch.Generator().manual_seed(1)
    for T, H, K, dtype in ((1, 64, 1, torch.float32), (9, 128, 3, torch.bfloat16)):
        yield (torch.randn(T, H, generator=gen).to(dtype), torch.randn(T, H, generator=gen).to(dtype),
               torch.rand(H, generator=gen).to(dtype), 1e-6, torch.randn(T, K * H, generator=gen).to(dtype), 0)


def _fc_samples():
    gen = torch.Generator().manual_seed(2)
    for R, H, K, N, opts in ((4, 64, 3, 32, ()), (9, 32, 2, 48, ("bias", "rows", "chunk", "inorm")),
                             (1, 64, 1, 16, ("rows",))):
        x = torch.randn(R, K * H, generator=gen)
        w = torch.randn(N, K * H, generator=gen)
        yield (x, w, torch.randn(N, generator=gen) if "bias" in opts else None,
               torch.tensor([R - 1, 0, R // 2]) if "rows" in opts else None,
               torch.rand(K, H, generator=gen) if "chunk" in opts else None,
               torch.rand(K * H, generator=gen) if "inorm" in opts else None, 1e-6)


@pytest.mark.parametrize("args", list(_capture_samples()))
def test_opcheck_capture(args):
    torch.library.opcheck(torch.ops.eagle3.capture.default, args)


@pytest.mark.parametrize("args", list(_fused_samples()))
def test_opcheck_fused_add_rmsnorm_capture(args):
    torch.library.opcheck(torch.ops.eagle3.fused_add_rmsnorm_capture.default, args)


@pytest.mark.parametrize("args", list(_fc_samples()))
def test_opcheck_draft_fc(args):
    torch.library.opcheck(torch.ops.eagle3.draft_fc.default, args)


@pytest.mark.parametrize("args", list(_fc_samples()))
def test_opcheck_draft_fc_out(args):
    x, w, b, rows, cn, inw, eps = args
    M = x.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(M, w.shape[0])
    torch.library.opcheck(torch.ops.eagle3.draft_fc_out.default, (*args, out))


def test_torch_compile_fullgraph_draft_input_path():
    T, H, K, N = 6, 64, 3, 32
    gen = torch.Generator().manual_seed(3)
    hs = [torch.randn(T, H, generator=gen) for _ in range(K)]
    rs = [torch.randn(T, H, generator=gen) for _ in range(K)]
    w = torch.randn(N, K * H, generator=gen)
    norm_w = torch.rand(H, generator=gen)
    chunk_w = torch.rand(K, H, generator=gen)
    rows = torch.tensor([5, 0, 2])

    def path(buffer, x0, r0):
        eagle3_ops.fused_add_rmsnorm_capture(x0, r0, norm_w, 1e-6, buffer, 0)
        for k in range(1, K):
            eagle3_ops.capture(hs[k], rs[k], buffer, k)
        return eagle3_ops.draft_fc(buffer[:T], w, None, rows, chunk_w, None, 1e-6) * 2.0

    eager_buf, comp_buf = torch.zeros(T, K * H), torch.zeros(T, K * H)
    e_x, e_r = hs[0].clone(), rs[0].clone()
    c_x, c_r = hs[0].clone(), rs[0].clone()
    want = path(eager_buf, e_x, e_r)
    got = torch.compile(path, fullgraph=True, backend="aot_eager")(comp_buf, c_x, c_r)
    assert torch.equal(got, want)
    assert torch.equal(comp_buf, eager_buf) and torch.equal(c_x, e_x) and torch.equal(c_r, e_r)


def test_torch_compile_inductor_draft_fc():
    x = torch.randn(5, 96)
    w = torch.randn(16, 96)
    fn = torch.compile(lambda a: eagle3_ops.draft_fc(a, w) + 1.0, fullgraph=True)
    torch.testing.assert_close(fn(x), eagle3_ops.draft_fc(x, w) + 1.0)


def test_fake_impl_reports_bad_shapes_at_trace_time():
    w = torch.randn(16, 96)
    fn = torch.compile(lambda a: eagle3_ops.draft_fc(a, w), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="weight has shape"):
        fn(torch.randn(5, 95))
