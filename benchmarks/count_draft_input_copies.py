"""Bytes written on the EAGLE-3 draft-input path, stock SGLang vs the plugin: counted on the CPU
(SGLang 0.5.23's own model code, CPU harness), per prefill and per decode step.

    python benchmarks/count_draft_input_copies.py [--json]

What is counted: every write of aux-state bytes between the target's layers and the draft's input,
from the capture to the tensor the draft's first step reads, in units of one ``[T, K*H]`` tensor:

* the captures: SGLang's ``hidden.clone()`` per captured layer (``AuxHiddenStateList.capture``) or
  the plugin's slot writes (its bound ``capture`` / the slot part of its bound ``fused_add_rmsnorm_capture``,
  ``eagle3_ops.bound``: marked where the install binds them, the backend's own aten ops inside not counted
  again; the public ops ``eagle3::capture`` / ``eagle3::fused_add_rmsnorm_capture`` are counted alike);
* ``torch.cat`` / any other op whose output is ``[*, K*H]`` (``pack_aux_hidden_states``);
* ``copy_`` into a ``[*, K*H]`` destination (the graph runners' static buffers and the BCG shared
  output buffer) or into a ``[T, H]`` slot of one (SGLang's ``AuxHiddenStatePacker``), or of a
  captured ``[T, H]`` (the BCG copy of SGLang's list), unless destination and source are the same
  view (torch then returns without a kernel).

Counted with a TorchDispatchMode around the steps below. The CUDA-graph runners cannot run on a
CPU, so their copies are reproduced: the target prefill BCG copy with SGLang's own
``BreakableCudaGraphBackend._alloc_full_buffer`` / ``_copy_output_to_buffer`` (hooked by the plugin
when it is on), and the draft runners' refresh copies with the statements SGLang 0.5.23 runs
(``static[:T].copy_(spec_info.hidden_states)``, checked in tests/sglang/test_static_inputs.py) on
the static buffers the plugin's hooks leave (aliased or not). The decode step is a TARGET_VERIFY
forward (its graph holds the model forward and the logits processor's pack) and the draft-extend
refresh copy. topk = 1 (chain) as in SGLang's default EAGLE-3; CUDA-graph padding rows are not
counted (stock copies padded rows too).
"""
from __future__ import annotations

import json
import os
import sys
import types

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LAYER_IDS = [0, 1, 2]
PREFILL = [[5, 17, 3, 99, 42, 7, 1, 64]]                 # T = 8
VERIFY = [[9, 31, 2, 77], [54, 6, 101, 13]]               # B = 2 requests x D = 4 draft tokens


class AuxWrites(TorchDispatchMode):
    """Bytes written into aux-state tensors (see the module docstring)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.width, self.hidden = width, hidden
        self.in_capture = 0
        self.in_bound = 0          # inside one of the plugin's bound capture calls (counted once, by mark())
        self.active = False        # inside ``with counter:``
        self.aux_sources = set()   # data_ptrs of the [T, H] aux leaves a copy may read (stock list path)
        self.rows = []   # (what, bytes)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.in_bound:
            return out
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        ns = getattr(func, "namespace", "")
        if ns == "eagle3" and name in ("capture", "fused_add_rmsnorm_capture"):
            hidden = args[0]
            self.rows.append((f"eagle3.{name} slot write", hidden.numel() * hidden.element_size()))
        elif func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            same = (dst.data_ptr() == src.data_ptr() and dst.shape == src.shape and dst.stride() == src.stride()
                    and dst.dtype == src.dtype)
            if dst.dim() == 2 and dst.shape[-1] == self.width and not same:
                self.rows.append(("copy_ into [*, K*H]", dst.numel() * dst.element_size()))
            elif dst.dim() == 2 and dst.stride(0) == self.width and not same:
                self.rows.append(("copy_ into a [T, H] slot of [T, K*H]", dst.numel() * dst.element_size()))
            elif src.data_ptr() in self.aux_sources and not same:
                self.rows.append(("copy_ of a captured [T, H]", dst.numel() * dst.element_size()))
        elif func is torch.ops.aten.clone.default and self.in_capture:
            self.rows.append(("clone (AuxHiddenStateList.capture)", out.numel() * out.element_size()))
        elif isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[-1] == self.width \
                and ns == "aten" and name in ("cat", "clone", "index_select", "index", "_to_copy"):
            self.rows.append((f"{name} -> [*, K*H]", out.numel() * out.element_size()))
        return out

    def total(self) -> int:
        return sum(b for _, b in self.rows)

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def mark(self, name: str, fn):
        """``fn`` (a bound capture op: hidden or input first) counted as one slot write of its [T, H] while
        this mode is active (as the dispatch mode counts the ops)."""
        def call(*args):
            if not self.active:
                return fn(*args)
            self.rows.append((f"eagle3.{name} slot write", args[0].numel() * args[0].element_size()))
            self.in_bound += 1
            try:
                return fn(*args)
            finally:
                self.in_bound -= 1

        return call


def _mark_bound_captures(counter: AuxWrites):
    """The plugin's bound capture calls, as its install makes them (dispatch.verified_function), marked."""
    from eagle3_ops import dispatch

    original = dispatch.verified_function

    def verified_function(op, *args, **kwargs):
        fn = original(op, *args, **kwargs)
        return counter.mark(op, fn) if op in ("capture", "fused_add_rmsnorm_capture") else fn

    dispatch.verified_function = verified_function
    return lambda: setattr(dispatch, "verified_function", original)


def _flag_captures(counter: AuxWrites):
    """Mark SGLang's AuxHiddenStateList.capture (its clone is a capture write)."""
    from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList

    original = AuxHiddenStateList.capture

    def capture(self, *args, **kwargs):
        counter.in_capture += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.in_capture -= 1

    AuxHiddenStateList.capture = capture
    return lambda: setattr(AuxHiddenStateList, "capture", original)


def _inner(h, model, kv, fb):
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    kv.backend.init_forward_metadata(fb)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=kv.backend)):
        return model.model(fb.input_ids, fb.positions, fb)


def count(plugin: bool, family: str = "llama", dtype=torch.bfloat16) -> dict:
    """{"prefill": {...}, "decode": {...}} for one tiny target of ``family`` (K=3, H=64). One
    target alive at a time, as in an SGLang worker (the plugin refuses to choose between several
    capture buffers for a static draft input)."""
    import weakref

    from eagle3_ops.sglang import capture_hooks
    from eagle3_ops.demos import sglang_cpu_harness as h
    from eagle3_ops.sglang import static_inputs
    from sglang.srt.layers.aux_hidden_states import pack_aux_hidden_states
    from sglang.srt.model_executor.runner_backend.breakable_cuda_graph_backend import BreakableCudaGraphBackend

    cfg = h.FAMILIES[family].make_config()
    model = h.sglang_model(family, cfg, dtype, seed=0)
    installed, capture_hooks._installed = capture_hooks._installed, weakref.WeakSet()
    H, KH = cfg.hidden_size, len(LAYER_IDS) * cfg.hidden_size
    counter = AuxWrites(KH, H)
    if plugin:
        unmark = _mark_bound_captures(counter)
        try:
            h.configure_capture(model, LAYER_IDS)   # the plugin's hook installs the buffer and binds its calls
        finally:
            unmark()
    else:
        model.set_eagle3_layers_to_capture(LAYER_IDS)  # what SGLang does without the plugin
    bcg = BreakableCudaGraphBackend.__new__(BreakableCudaGraphBackend)

    class PrefillRunner:  # the draft's prefill BCG runner: its static input (SGLang: torch.zeros)
        def __init__(self):
            self.static_draft_hidden_states = torch.zeros(64, KH, dtype=dtype)
            self.model_runner = types.SimpleNamespace(is_draft_worker=True)

    class ExtendRunner:   # the draft-extend graph runner after verify
        def __init__(self):
            self.buffers = types.SimpleNamespace(hidden_states=torch.zeros(64, KH, dtype=dtype))

    draft_prefill, draft_extend = PrefillRunner(), ExtendRunner()
    if plugin:  # what the plugin's BEFORE-capture hooks do (they are hooks on SGLang's runners)
        static_inputs.before_draft_prefill_capture(draft_prefill)
        static_inputs.before_draft_extend_capture(draft_extend)

    kv = h.KVCache(cfg, dtype)
    reqs = [h.Req(kv.new_req()) for _ in VERIFY]
    result = {}
    undo = _flag_captures(counter)
    try:
        # ---- prefill (one request of T tokens; target BCG, then the draft's prefill BCG) ----
        T = len(PREFILL[0])
        fb = h.extend_batch(kv, reqs[:1], PREFILL)
        with torch.no_grad():
            out = _inner(h, model, kv, fb)                       # warm-up output -> the BCG buffer
            buffer = bcg._alloc_full_buffer(out, 16)
        with counter:
            fb = h.extend_batch(kv, [h.Req(kv.new_req())], PREFILL)
            out = _inner(h, model, kv, fb)                       # captured in the target's BCG
            counter.aux_sources = {t.data_ptr() for t in (out[1] if isinstance(out[1], list) else [])}
            bcg._copy_output_to_buffer(out, buffer, T)           # in-graph copy to the shared output
            counter.aux_sources = set()
            aux = pack_aux_hidden_states(buffer[1][:T] if torch.is_tensor(buffer[1])
                                         else [b[:T] for b in buffer[1]])  # logits processor
            draft_prefill.static_draft_hidden_states[:T].copy_(aux)   # draft BCG load_batch
        result["prefill"] = {"tokens": T, "bytes": counter.total(), "rows": list(counter.rows),
                             "units": counter.total() / (T * KH * torch.tensor([], dtype=dtype).element_size())}
        counter.rows.clear()
        # ---- decode step (TARGET_VERIFY of B x D tokens, then the draft-extend graph) ----
        with counter:
            fb = h.extend_batch(kv, reqs, VERIFY, mode="TARGET_VERIFY")
            out = _inner(h, model, kv, fb)                       # inside the verify graph
            aux = pack_aux_hidden_states(out[1])                 # logits processor, inside the graph
            n = aux.shape[0]
            draft_extend.buffers.hidden_states[:n].copy_(aux)    # EAGLEDraftExtendCudaGraphRunner.execute
        result["decode"] = {"tokens": n, "bytes": counter.total(), "rows": list(counter.rows),
                            "units": counter.total() / (n * KH * torch.tensor([], dtype=dtype).element_size())}
    finally:
        undo()
        capture_hooks._installed = installed
    return result


def kimi_bytes(units: float, tokens: int, K: int = 3, H: int = 7168, elem: int = 2) -> float:
    return units * tokens * K * H * elem


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python benchmarks/count_draft_input_copies.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    args = ap.parse_args(argv)
    from eagle3_ops.demos import sglang_cpu_harness as h

    h.disable_dynamo()
    h.init_distributed()
    families = ("llama", "deepseek_v2")
    stock = {f: count(plugin=False, family=f) for f in families}
    assert h.plugin_install()
    ours = {f: count(plugin=True, family=f) for f in families}
    report = {"stock": stock, "plugin": ours}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    for family in families:
        print(f"\n== {family} (tiny: K=3, H=64, bf16): aux-state bytes written per step, counted on CPU")
        for step, tokens_kimi in (("prefill", 8192), ("decode", 32 * 4)):
            s, o = stock[family][step], ours[family][step]
            print(f"{step} ({s['tokens']} tokens): stock {s['bytes']} B = {s['units']:.2f} x [T, K*H]; "
                  f"plugin {o['bytes']} B = {o['units']:.2f} x [T, K*H]")
            for label, rows in (("stock", s["rows"]), ("plugin", o["rows"])):
                for what, b in rows:
                    print(f"  {label:6s} {what:44s} {b:8d} B")
            print(f"  scaled to K=3, H=7168, bf16, {tokens_kimi} tokens: stock "
                  f"{kimi_bytes(s['units'], tokens_kimi) / 1e6:.1f} MB, plugin "
                  f"{kimi_bytes(o['units'], tokens_kimi) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
