"""Engine-side STATES for ``doctor --replay``: record, during normal serving, the hidden states
SGLang itself captures, at the boundaries the replay needs.

Switched on by ``EAGLE3_OPS_DUMP_STATES=PATH`` (off by default). For the first
``EAGLE3_OPS_DUMP_TOKENS`` (default 2048) prefill tokens of sequences that start at position 0
(EXTEND/MIXED forwards; decode, verify and draft forwards are never recorded) the plugin keeps:

* each boundary the replay needs: every configured boundary (``layers_to_capture``) and its two
  neighbours, the embeddings (boundary 0) and the last layer's output before the final norm
  (boundary L); ``EAGLE3_OPS_DUMP_BOUNDARIES=all`` records every boundary 0..L;
* the token ids, where each sequence starts, and the target's greedy next token at every position
  (argmax of the lm_head over the final-normed hidden state; at TP > 1 each rank scores its vocab
  shard and the ranks agree through one all-gather of (max, index) per chunk).

Where the values come from: the same capture callbacks SGLang uses for its own EAGLE-3 captures
(``capture_output`` for llama/qwen2/qwen3, ``captured_last_layer_outputs`` for qwen2_moe/qwen3_moe
and deepseek_v2/V3/Kimi), passed into the decoder layers the dump needs, so each value is taken
after the layer boundary completed the tensor-parallel all-reduce, exactly as SGLang captures it;
boundary L comes from the ``capture`` argument of SGLang's ``residual_batch.final_norm`` (where
gpt_oss takes its own capture of boundary L). Only TP rank 0 keeps values (copied to host memory
at once); every rank takes part in the next-token all-gather.

What it costs and what it changes:
* host memory: tokens x boundaries x hidden x 2 bytes (logged at install), freed after writing;
* a device-to-host copy per recorded boundary, only in recorded forwards (never during CUDA-graph
  capture: those forwards are skipped);
* served outputs: a layer that gets a dump capture completes its deferred all-reduce before its
  input norm, as SGLang does for its own captured layers. At TP = 1 that changes nothing (tested
  bitwise on CPU); at TP > 1 with SGLang's fused all-reduce+add+RMSNorm (FlashInfer, sm_90/sm_100)
  that layer's add+norm runs unfused in the recorded forwards only, which can change rounding there.
* forwards replayed from a prefill CUDA graph do not run Python, so a prefill the recorder wants is
  run eagerly instead (:func:`around_can_run_graph`, AROUND ``PrefillCudaGraphRunner.can_run_graph``;
  every TP rank sees the same batch and decides the same); until the recording is written, those
  prefills only. In an EAGLE-3 server only the scheduler's batches are recorded (they carry its
  ``spec_algorithm``), never SGLang's graph-capture or compile warm-ups (eager dummy EXTENDs).
* not under DP attention: each TP rank runs another batch there, so the next-token all-gather would
  pair rows of different requests and wait for ranks that never reach it (one line; off).
* a rank that fails while recording (host memory, say) stops keeping values but keeps taking part in
  the all-gathers, so no rank is left waiting; nothing raised here reaches SGLang's forward.

When the budget is full (or at process exit with anything recorded) rank 0 writes one
safetensors file, format ``eagle3_ops.doctor.states/2`` (see ``eagle3_ops.doctor.states``), and
logs one line saying where and what.
"""
from __future__ import annotations

import atexit
import inspect
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ..doctor.states import (ENV_DUMP_BOUNDARIES, ENV_DUMP_STATES, ENV_DUMP_TOKENS, DumpSettings, StatesError,
                             needed_boundaries, write_states)
from ..files import os_error_words
from ..settings import SettingError, report_once
from .capture_hooks import find_capture_owner

log = logging.getLogger("eagle3_ops.sglang")

_STATE_ATTR = "_eagle3_ops_dump"
NEXT_TOKEN_CHUNK = 256  # rows per lm_head chunk: bounds the transient logits to 256 x vocab/tp floats

_tls = threading.local()
_recorders: List["StatesRecorder"] = []


def _compiling() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # pragma: no cover
        return False


def _capturing_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def server_args():
    """SGLang's server args in a server process, else None (a script, a test)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        sa = get_server_args()
    except Exception:
        return None
    return sa if sa is not None and hasattr(sa, "speculative_algorithm") else None


def _scheduled(fb) -> bool:
    """Whether ``fb`` may be a batch the scheduler made for requests: an EAGLE-3 server's target batches
    carry its ``spec_algorithm``; the dummy batches of the prefill-graph capture's eager warm-up
    (EXTEND, prefix 0, token ids of a static buffer) carry none. Warm-ups through ``_dummy_run`` carry
    it: :func:`_warming_up` marks those."""
    return getattr(fb, "spec_algorithm", None) is not None  # NONE too: a scheduler batch of a server without one


# SGLang's shared warm-up forward: CUDA-graph and autotune passes, DeepGEMM's compile warm-up, PD
# prefill's FlashInfer extend autotune (SGLANG_FLASHINFER_AUTOTUNE_EXTEND). Its batches carry the
# runner's spec_algorithm and may be EXTEND from position 0, so only this marks them as not a prompt.
DUMMY_RUN_TARGET = "sglang.srt.model_executor.runner.base_runner.BaseRunner._dummy_run"


def around_dummy_run(original, *args, **kwargs):
    """AROUND ``BaseRunner._dummy_run``: forwards inside it are warm-ups, never recorded."""
    _tls.dummy_runs = getattr(_tls, "dummy_runs", 0) + 1
    try:
        return original(*args, **kwargs)
    finally:
        _tls.dummy_runs -= 1


def _warming_up() -> bool:
    """Inside SGLang's ``_dummy_run`` or a FlashInfer autotune pass (its own flag)."""
    if getattr(_tls, "dummy_runs", 0) > 0:
        return True
    try:
        from sglang.srt.layers.logits_processor import get_in_autotune_dummy_run

        return bool(get_in_autotune_dummy_run())
    except Exception:
        return False


def pipeline_parallel() -> bool:
    """PP > 1: each stage holds some layers only and the last one the logits, so no rank sees every
    boundary the replay needs and its next tokens (and PP's dynamic-chunking profile runs random
    prompts through the scheduler's own batches)."""
    sa = server_args()
    try:
        return int(getattr(sa, "pp_size", 1) or 1) > 1
    except (TypeError, ValueError):
        return False


def custom_warmups() -> Optional[str]:
    """SGLang's ``--warmups`` (e.g. ``prefill_shapes``, ``voice_chat``), or None: the server sends those
    through the scheduler as ordinary requests of random token ids before any user prompt, so a
    recording would take them for the first prompts."""
    try:
        from sglang.srt.runtime_context import get_serving

        value = get_serving().warmups
    except Exception:
        sa = server_args()
        value = getattr(sa, "warmups", None) if sa is not None else None
    return value if isinstance(value, str) and value else None


def dp_attention_enabled() -> bool:
    """DP attention: each TP rank runs another batch, so a recording's all-gather would pair rows of
    different requests and wait for ranks that never reach it."""
    sa = server_args()
    if sa is not None and getattr(sa, "enable_dp_attention", False):
        return True
    try:
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled

        return bool(is_dp_attention_enabled())
    except Exception:
        return False


class _Forward:
    """One target forward being recorded (or skipped: ``rows`` is None)."""

    def __init__(self, forward_batch, rows: Optional[torch.Tensor], seq_lens: List[int], num_tokens: int):
        self.forward_batch = forward_batch
        self.rows = rows                 # rows of the forward's T tokens that are kept (host int64), or None
        self.rows_dev: Optional[torch.Tensor] = None
        self.seq_lens = seq_lens         # kept tokens per recorded sequence
        self.num_tokens = num_tokens     # T of the forward
        self.values: Dict[int, torch.Tensor] = {}


class _Accumulator:
    """Duck-types SGLang's aux accumulator (``capture(value, owned=...)``) for the qwen-MoE and
    DeepSeek layers: records boundary ``b`` and forwards to the layer's own accumulator, if any."""

    def __init__(self, recorder: "StatesRecorder", boundary: int, inner):
        self.recorder, self.boundary, self.inner = recorder, boundary, inner

    def capture(self, value, *args, **kwargs):
        """Record ``value`` at this boundary, then hand it to SGLang's own accumulator (if any) unchanged."""
        self.recorder.record(self.boundary, value)
        if self.inner is not None:
            return self.inner.capture(value, *args, **kwargs)
        return None

    def __getattr__(self, name):  # anything else SGLang asks of its accumulator
        if self.inner is None:
            raise AttributeError(name)
        return getattr(self.inner, name)


class StatesRecorder:
    """Records, during serving, SGLang's own captures at ``boundaries`` for the first ``settings.tokens``
    prefill tokens of sequences that start at position 0 and have at least ``min_prompt_tokens`` tokens,
    in forwards of at least ``min_forward_tokens`` tokens. ``on_written(path or None)`` is called once
    the recording is written (rank 0: the file; other ranks: None). ``label`` names the feature in its
    log lines (the states dump, or the live wiring check)."""

    def __init__(self, lm, inner, settings: DumpSettings, boundaries: List[int], tp_rank: int, tp_size: int,
                 *, min_prompt_tokens: int = 2, min_forward_tokens: int = 0, close_after: Optional[int] = None,
                 on_written=None, label: str = ENV_DUMP_STATES, advice=None):
        self.lm, self.inner, self.settings = lm, inner, settings
        # advice(kind, folder): what the user of this feature can change when its file does not fit ("memory",
        # "disk", "fsize", "permission", "other"); the states dump's variables unless the feature gives its own
        self.advice = advice if advice is not None else (lambda kind, folder: dump_advice(kind, folder, settings))
        self.min_prompt_tokens, self.min_forward_tokens = max(2, int(min_prompt_tokens)), int(min_forward_tokens)
        self.on_written, self.label = on_written, label
        # the recording closes after the forward that brings it to this many tokens (default: the budget);
        # every rank counts the same rows, so every rank closes after the same forward
        self.close_after = settings.tokens if close_after is None else min(int(close_after), settings.tokens)
        self.num_layers = _num_layers(inner)
        self.hidden_size = int(lm.config.hidden_size) if hasattr(lm, "config") else int(inner.config.hidden_size)
        self.boundaries = boundaries
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.keep_values = tp_rank == 0
        self.remaining = settings.tokens
        self.prompts: List[dict] = []
        self.configured = sorted(set(int(i) for i in inner.layers_to_capture))
        self.missing_boundaries: set = set()
        self.done = False
        self.handles = []
        self.unreachable: List[int] = []
        self.max_bytes = 0
        self.model = None                 # the model SGLang's runner holds (install_recorder)
        # in an EAGLE-3 server, only the scheduler's batches (not SGLang's warm-up forwards) are recorded
        sa = server_args()
        self.scheduled_only = sa is not None and (getattr(sa, "speculative_algorithm", None) is not None or
                                                  bool(getattr(sa, "enable_return_aux_hidden_states", False)))
        self.background_write = False     # write the file in a thread (the live check), not in the forward
        self.writer: Optional[threading.Thread] = None  # that thread, once started
        self.writer_daemon = True         # the states dump's is not: the interpreter finishes it before exit
        self.failure: Optional[str] = None  # why this rank stopped keeping values (it still takes part)
        self.lock = threading.Lock()

    # ---- per forward -------------------------------------------------------------------------------
    def begin(self, forward_batch) -> _Forward:
        """Open (or re-use) the record of the forward ``forward_batch`` on this thread."""
        cur = getattr(_tls, "forward", None)
        if cur is not None and cur.forward_batch is forward_batch:
            return cur
        cur = self._plan(forward_batch)
        _tls.forward = cur
        return cur

    def _plan(self, fb) -> _Forward:
        skip = _Forward(fb, None, [], 0)
        if self.done or self.remaining <= 0 or _compiling() or _capturing_graph():
            return skip
        mode = getattr(fb, "forward_mode", None)
        if getattr(mode, "name", None) not in ("EXTEND", "MIXED"):  # never verify, decode or draft forwards
            return skip
        if self.scheduled_only and (not _scheduled(fb) or _warming_up()):  # SGLang's warm-up forwards
            return skip
        ids = getattr(fb, "input_ids", None)
        lens = getattr(fb, "extend_seq_lens_cpu", None)
        prefix = getattr(fb, "extend_prefix_lens_cpu", None)
        if ids is None or lens is None or prefix is None or sum(int(x) for x in lens) != ids.shape[0]:
            return skip
        if ids.shape[0] < self.min_forward_tokens:
            return skip
        media = getattr(fb, "mm_inputs", None)  # per sequence: images / audio in its prompt, or None
        rows, kept, start, budget = [], [], 0, self.remaining
        for i, (n, p) in enumerate(zip(lens, prefix)):
            n, p = int(n), int(p)
            # a text sequence from its first token (at media positions the ids are placeholders and the
            # target read encoder embeddings: a replay from the ids would score something else)
            text = media is None or i >= len(media) or media[i] is None
            if p == 0 and budget > 0 and n >= self.min_prompt_tokens and text:
                take = min(n, budget)
                rows.append(torch.arange(start, start + take))
                kept.append(take)
                budget -= take
            start += n
        if not rows:
            return skip
        return _Forward(fb, torch.cat(rows), kept, int(ids.shape[0]))

    def wants(self, forward_batch) -> bool:
        """Whether this forward would be recorded (read from the batch's CPU fields; no side effect)."""
        return self._plan(forward_batch).rows is not None

    def record(self, boundary: int, value) -> None:
        """Keep this forward's recorded rows of ``value`` ([T, H], post all-reduce) for ``boundary``; a value of
        another shape marks the boundary missing instead. Host copies on TP rank 0 only."""
        cur = getattr(_tls, "forward", None)
        if cur is None or cur.rows is None or not self.keep_values or boundary in cur.values:
            return
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != cur.num_tokens:
            self.missing_boundaries.add(boundary)
            return
        try:
            if cur.rows_dev is None or cur.rows_dev.device != value.device:
                cur.rows_dev = cur.rows.to(value.device)
            cur.values[boundary] = value.index_select(0, cur.rows_dev).to("cpu", copy=True)
        except Exception as e:  # host memory, a device error: never into SGLang's forward
            self.stop_keeping(e)

    def stop_keeping(self, error: BaseException) -> None:
        """This rank can keep no values: it drops them and goes on taking part in the next-token
        all-gathers, so the other ranks are never left waiting; the recording then ends with nothing
        written, and the reason is in :attr:`failure` (the states dump says it here; another feature, whose
        ``on_written`` follows, says it in its own line)."""
        if self.failure is None:
            self.failure = f"recording failed on TP rank {self.tp_rank} ({cause(error)})"
            if self.label == ENV_DUMP_STATES or self.on_written is None:
                log.error("eagle3_ops: %s: %s; %s", self.label, self.failure, _off(self.label))
            log.debug("eagle3_ops: %s: the recording's failure", self.label, exc_info=error)
        self.keep_values = False
        with self.lock:
            self.prompts = []

    def finish(self, cur: _Forward, normed) -> None:
        """After the final norm: the greedy next tokens, then keep the forward's sequences."""
        _tls.forward = None
        if cur.rows is None:
            return
        if not isinstance(normed, torch.Tensor) or normed.dim() != 2 or normed.shape[0] != cur.num_tokens:
            return
        try:
            nxt = self._greedy_next(normed, cur)  # every rank: the one collective
            if self.keep_values:  # rank 0 (a rank > 0 takes part in the all-gathers only)
                try:
                    self._keep(cur, nxt)
                except Exception as e:  # local
                    self.stop_keeping(e)
        finally:  # the count, and so the forward the recording closes after, is the same on every rank
            self.remaining -= int(cur.rows.numel())
            if self._full():
                self.write(in_forward=True)

    def _keep(self, cur: _Forward, nxt: torch.Tensor) -> None:
        ids = cur.forward_batch.input_ids.index_select(0, cur.rows.to(cur.forward_batch.input_ids.device)).cpu()
        pos = 0
        with self.lock:
            for n in cur.seq_lens:
                p = {"input_ids": ids[pos:pos + n].long(), "next_token": nxt[pos:pos + n].long(),
                     "boundaries": {b: v[pos:pos + n] for b, v in cur.values.items()}}
                self.prompts.append(p)
                pos += n
            for b in self.boundaries:
                if b not in cur.values:
                    self.missing_boundaries.add(b)

    def _full(self) -> bool:
        return self.remaining <= 0 or self.settings.tokens - self.remaining >= self.close_after

    def _greedy_next(self, normed: torch.Tensor, cur: _Forward) -> torch.Tensor:
        head = self.lm.lm_head
        weight = head.weight
        idx = getattr(head, "shard_indices", None)
        lo = int(getattr(idx, "org_vocab_start_index", 0)) if idx is not None else 0
        hi = int(getattr(idx, "org_vocab_end_index", weight.shape[0])) if idx is not None else weight.shape[0]
        rows = cur.rows
        out = []
        with torch.no_grad():
            for s in range(0, rows.numel(), NEXT_TOKEN_CHUNK):
                n = int(rows[s:s + NEXT_TOKEN_CHUNK].numel())
                ok = 1.0
                try:
                    x = normed.index_select(0, rows[s:s + NEXT_TOKEN_CHUNK].to(normed.device))
                    logits = torch.nn.functional.linear(x.to(weight.dtype), weight[: hi - lo]).float()
                    best, arg = logits.max(dim=-1)
                except Exception as e:  # local (memory): this rank still joins the all-gather below
                    self.stop_keeping(e)
                    ok = 0.0
                    best = torch.full((n,), float("-inf"), device=normed.device)
                    arg = torch.zeros(n, dtype=torch.long, device=normed.device)
                if self.tp_size > 1:
                    from sglang.srt.distributed import tensor_model_parallel_all_gather

                    # [n, 3]: best logit, token id, and whether this rank computed them (a rank that
                    # could not would leave rank 0 an argmax over the other shards only)
                    pair = torch.stack([best.double(), (arg + lo).double(), torch.full_like(best.double(), ok)],
                                       dim=-1)
                    gathered = tensor_model_parallel_all_gather(pair, dim=-1).view(-1, self.tp_size, 3)
                    if bool((gathered[..., 2] == 0).any()):
                        self.stop_keeping(RuntimeError("another TP rank could not compute its next tokens"))
                    pick = gathered[..., 0].argmax(dim=-1)  # ties: the lowest rank = the lowest token id
                    arg = gathered[..., 1].gather(1, pick[:, None])[:, 0].long()
                else:
                    arg = arg + lo
                out.append(arg.cpu())
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    # ---- output --------------------------------------------------------------------------------------
    def _write_failure(self, e: BaseException) -> str:
        """Why the file could not be written, in one clause: the path, the OS error's name and words, and what
        the user of this feature can change (:attr:`advice`); a real bug says so (its traceback at DEBUG)."""
        path = self.settings.path
        if isinstance(e, OSError):
            folder = Path(e.filename).parent if e.filename else self.settings.target.parent
            return f"could not write {path}: {os_error_words(e)}; {self.advice(error_kind(e), folder)}"
        if isinstance(e, StatesError):  # the target became a directory, a FIFO, ... since start-up
            return f"could not write {path}: {e}"
        log.debug("eagle3_ops: %s: writing %s failed", self.label, path, exc_info=e)
        return f"could not write {path}: {cause(e)}{bug_note(e)}"

    def write(self, in_forward: bool = False) -> Optional[str]:
        """Close the recording and write its file: in a thread of its own when called from a forward and
        :attr:`background_write` is set (serving goes on meanwhile; :meth:`wait` joins it), else here."""
        with self.lock:
            if self.done:
                return None
            self.done = True
            prompts, self.prompts = self.prompts, []
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.keep_values and self.background_write and in_forward:  # off the forward's thread
            writer = threading.Thread(target=self._write_and_follow, args=(prompts,), name="eagle3_ops-recording",
                                      daemon=self.writer_daemon)
            writer.start()
            self.writer = writer  # assigned once started, so whoever sees it can join it
            return None
        return self._write_and_follow(prompts if self.keep_values else None)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Until a file written in the background is written (tests and tools; SGLang never waits)."""
        if self.writer is not None:
            self.writer.join(timeout)

    def _write_and_follow(self, prompts) -> Optional[str]:
        written = self._write(prompts) if prompts is not None else None
        if self.on_written is not None:
            try:
                self.on_written(written)
            except Exception as e:  # never stop SGLang (e.g. no thread can be started: a process limit)
                log.warning("eagle3_ops: %s: the follow-up of the recording failed (%s); serving is unaffected%s",
                            self.label, cause(e), bug_note(e))
                log.debug("eagle3_ops: %s: the follow-up's traceback", self.label, exc_info=e)
        return written

    def _write(self, prompts) -> Optional[str]:
        if not prompts:
            if self.label == ENV_DUMP_STATES:
                log.warning("eagle3_ops: %s=%s: no prefill of at least %d tokens from position 0 was recorded; "
                            "nothing written", ENV_DUMP_STATES, self.settings.path, self.min_prompt_tokens)
            return None
        recorded = sorted(set().union(*(p["boundaries"].keys() for p in prompts)))
        try:
            summary = write_states(self.settings.path, prompts, num_layers=self.num_layers,
                                   hidden_size=self.hidden_size, boundaries=recorded,
                                   meta={"source": "sglang (eagle3_ops plugin: post all-reduce, TP rank 0)",
                                         "layers_to_capture": ",".join(map(str, self.configured)),
                                         "model": type(self.lm).__name__})
        except Exception as e:  # never stop SGLang: the cause (the OS error's name, the path) and what to change
            self.failure = self._write_failure(e)
            if self.label == ENV_DUMP_STATES or self.on_written is None:
                log.error("eagle3_ops: %s: %s", self.label, self.failure)
            return None
        if self.label != ENV_DUMP_STATES:
            return str(self.settings.path)
        missing = sorted(set(self.boundaries) - set(recorded))
        log.info("eagle3_ops: wrote %s: %d prefill tokens in %d sequences, boundaries %s (SGLang captures %s), "
                 "%.1f MiB%s; check the draft with: python -m eagle3_ops doctor --draft DRAFT --target TARGET "
                 "--replay %s", self.settings.path, summary["tokens"], summary["prompts"], recorded,
                 self.configured, summary["bytes"] / 2**20,
                 f"; not recorded: {missing}" if missing else "", self.settings.path)
        return str(self.settings.path)


# ---- installation ---------------------------------------------------------------------------------
def _layer_capture_kind(layer) -> Optional[str]:
    try:
        params = inspect.signature(type(layer).forward).parameters
    except (TypeError, ValueError):
        return None
    if "capture_output" in params:
        return "capture_output"
    if "captured_last_layer_outputs" in params:
        return "captured_last_layer_outputs"
    return None


def _layer_pre_hook(recorder: StatesRecorder, boundary: int, kind: str):
    def hook(module, args, kwargs):
        if _compiling() or recorder.done:
            return None
        fb = kwargs.get("forward_batch", args[2] if len(args) > 2 else None)
        if fb is None:
            return None
        try:  # _plan reads the batch's CPU fields: the same on every rank
            if recorder.begin(fb).rows is None:
                return None
        except Exception as e:  # never into SGLang's forward
            recorder.stop_keeping(e)
            return None
        existing = kwargs.get(kind)
        if kind == "capture_output":
            def capture(value, *a, **kw):
                recorder.record(boundary, value)
                if existing is not None:
                    return existing(value, *a, **kw)
                return None

            kwargs[kind] = capture
        else:
            kwargs[kind] = _Accumulator(recorder, boundary, existing)
        return args, kwargs

    return hook


def final_norm_hook(original, *args, **kwargs):
    """AROUND SGLang's ``residual_batch.final_norm``: records boundary L and closes the forward."""
    if _compiling():
        return original(*args, **kwargs)
    cur = getattr(_tls, "forward", None)
    if cur is None:
        return original(*args, **kwargs)
    layernorm = kwargs.get("layernorm", args[2] if len(args) > 2 else None)
    recorder = next((r for r in _recorders if r.inner.norm is layernorm and not r.done), None)
    fb = kwargs.get("forward_batch", args[1] if len(args) > 1 else None)
    if recorder is None or fb is not cur.forward_batch:
        return original(*args, **kwargs)
    if recorder.num_layers in recorder.boundaries:
        existing = kwargs.pop("capture", args[3] if len(args) > 3 else None)
        args = args[:3]

        def capture(value, *a, **kw):
            recorder.record(recorder.num_layers, value)
            if existing is not None:
                return existing(value, *a, **kw)
            return None

        kwargs["capture"] = capture
    out = original(*args, **kwargs)
    try:
        recorder.finish(cur, out)
    except Exception as e:  # never stop SGLang (finish still counted this forward, as every rank does)
        recorder.stop_keeping(e)
    return out


def _requested_settings(settings: Optional[DumpSettings]) -> Tuple[bool, Optional[DumpSettings]]:
    """(requested, settings): whether the dump is asked for (EAGLE3_OPS_DUMP_STATES set: the same
    on every TP rank of a server) and its settings, None when a value is refused (one ERROR line)."""
    if settings is not None:
        return True, settings
    if not os.environ.get(ENV_DUMP_STATES, "").strip():
        return False, None
    try:
        return True, DumpSettings.from_env()
    except SettingError as e:
        report_once(e, log)
        return True, None


def _available_bytes(folder: Path) -> Tuple[Optional[int], Optional[int]]:
    """(host memory available, disk free in ``folder``) in bytes; None where it cannot be read."""
    memory = disk = None
    try:
        with open("/proc/meminfo") as f:
            memory = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    try:
        disk = shutil.disk_usage(folder).free
    except OSError:
        pass
    return memory, disk


def _file_size_limit() -> Optional[int]:
    """This process's file-size limit (``ulimit -f``, RLIMIT_FSIZE) in bytes, or None (unlimited)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def error_kind(e: BaseException) -> str:
    """Which advice fits an OS error: "disk" (full, quota), "fsize" (the file-size limit), "permission",
    "other"."""
    import errno

    code = getattr(e, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return "disk"
    if code == errno.EFBIG:
        return "fsize"
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "permission"
    return "other"


def dump_advice(kind: str, folder: Path, settings: DumpSettings) -> str:
    """What a user of the states dump can change when its recording does not fit (its own variables)."""
    if kind == "memory":
        return f"lower {ENV_DUMP_TOKENS}" + (f" or leave {ENV_DUMP_BOUNDARIES} at auto"
                                              if settings.boundaries == "all" else "")
    if kind == "disk":
        return (f"free space in {folder}, lower {ENV_DUMP_TOKENS}, or set {ENV_DUMP_STATES} to a file on a disk with "
                f"room")
    if kind == "fsize":
        return f"raise the server's file-size limit (ulimit -f) or lower {ENV_DUMP_TOKENS}"
    if kind == "permission":
        return f"set {ENV_DUMP_STATES} to a file in a folder this server's user can write"
    return f"set {ENV_DUMP_STATES} to a file on another disk"


def cause(e: BaseException) -> str:
    """An exception in words: an OS error by its errno's name, memory as memory."""
    if isinstance(e, OSError):
        return os_error_words(e) + (f": {e.filename}" if e.filename else "")
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, MemoryError) or "out of memory" in str(e).lower() or "can't allocate memory" in str(e):
        return f"out of memory ({text})"
    return text


def bug_note(e: BaseException) -> str:
    """For an error no user's machine explains (not an OS error, not memory): say it is a bug, where its
    traceback is."""
    if isinstance(e, (OSError, MemoryError, StatesError)) or "out of memory" in str(e).lower():
        return ""
    return " (an internal error of eagle3_ops: please report it; its traceback is logged at DEBUG level)"


def _room_problem(settings: DumpSettings, nbytes: int, advice=None) -> Optional[str]:
    """Why this machine cannot hold the recording (host memory), its file (disk) or a file that large (the
    process's file-size limit), or None. ``advice(kind, folder)``: what to change (default: the dump's)."""
    advice = advice or (lambda kind, folder: dump_advice(kind, folder, settings))
    folder = settings.target.parent
    memory, disk = _available_bytes(folder)
    need = f"recording up to {settings.tokens} prefill tokens needs up to {nbytes / 2**20:.1f} MiB"
    if memory is not None and nbytes > memory:
        return f"{need} of host memory and {memory / 2**20:.1f} MiB is available ({advice('memory', folder)})"
    if disk is not None and nbytes > disk:
        return f"{need} of disk and {folder} has {disk / 2**20:.1f} MiB free ({advice('disk', folder)})"
    limit = _file_size_limit()
    if limit is not None and nbytes > limit:
        return (f"{need} in one file and this process's file-size limit (ulimit -f, RLIMIT_FSIZE) is "
                f"{limit / 2**20:.1f} MiB: writing it would fail with EFBIG ({advice('fsize', folder)})")
    return None


def _recorded_modules(model):
    """(lm, inner) for a target configured for EAGLE-3 capture, else (None, None): ``inner`` the
    module whose forward runs the decoder loop and holds SGLang's ``layers_to_capture`` (the capture
    owner's, not ``lm.model``: Qwen2.5-VL flags that module itself), ``lm`` the closest module at or
    above it with an ``lm_head`` (the recorder's next-token head; a VL wrapper's own), else the
    module SGLang flagged ``capture_aux_hidden_states``."""
    owner, _ = find_capture_owner(model)
    if owner is None or not getattr(owner.lm, "capture_aux_hidden_states", False):
        return None, None
    modules = dict(model.named_modules()) if isinstance(model, torch.nn.Module) else {"": model}
    chain = [owner.path]
    while chain[-1]:
        chain.append(chain[-1].rsplit(".", 1)[0] if "." in chain[-1] else "")
    for name in chain:  # inner, its parent, ..., the model
        m = modules.get(name)
        if m is not None and isinstance(getattr(m, "lm_head", None), torch.nn.Module):
            return m, owner.inner
    return owner.lm, owner.inner


def install_dump(model, settings: Optional[DumpSettings] = None) -> Optional[StatesRecorder]:
    """Start recording for a target configured for EAGLE-3 capture (when the dump is switched on;
    ``settings`` None: read from the environment). Returns the recorder, or None (with one log
    line saying why). Under TP > 1 the ranks agree: every rank records (rank 0 keeps the values,
    all take part in the next-token all-gather) or none does."""
    lm, inner = _recorded_modules(model)
    if inner is None:
        return None
    if inner.__dict__.get(_STATE_ATTR) is not None:
        return inner.__dict__[_STATE_ATTR]
    requested, settings = _requested_settings(settings)
    if not requested:
        return None
    return install_recorder(model, settings, label=ENV_DUMP_STATES, atexit_write=True)


def wait_all(timeout: Optional[float] = None) -> None:
    """Until every recording written in the background is written (tests and tools)."""
    for rec in list(_recorders):
        rec.wait(timeout)


def server_refusal() -> Optional[Tuple[str, str]]:
    """(the server setting, why no recording can run under it), or None. A server setting: the same
    answer on every TP rank, so every rank refuses together (no collective is reached by one alone)."""
    if dp_attention_enabled():
        return "under DP attention", ("each TP rank runs another batch, so the recording's all-gather would "
                                      "pair different requests and could leave ranks waiting")
    if pipeline_parallel():
        return "under pipeline parallelism", ("each stage holds some layers only, the last the logits: no rank "
                                              "sees every state the replay needs")
    warmups = custom_warmups()
    if warmups is not None:
        return f"with --warmups {warmups}", ("the server's warm-up requests of random tokens would be recorded "
                                             "as the first prompts")
    return None


def _off(label: str) -> str:
    return "the states dump is off" if label == ENV_DUMP_STATES else f"the {label} is off"


def install_recorder(model, settings: Optional[DumpSettings], *, boundaries: Optional[List[int]] = None,
                     label: str = ENV_DUMP_STATES, atexit_write: bool = False, on_refused=None,
                     **recorder_kw) -> Optional[StatesRecorder]:
    """A recorder on ``model`` (one per model: the states dump or the live wiring check) at ``boundaries``
    (default: what ``settings.boundaries`` names), or None with one log line. Every TP rank calls this;
    they agree (every rank records or none). ``settings`` None: this rank refused its settings.
    ``on_refused(why)``: where this rank cannot record (the machine's room, an error), the caller says it in its
    own line instead of this module."""
    lm, inner = _recorded_modules(model)
    if inner is None:
        return None
    if inner.__dict__.get(_STATE_ATTR) is not None:
        return None  # one recorder per model: the other feature has it
    refused = server_refusal()
    if refused is not None:
        log.warning("eagle3_ops: %s: not %s (%s); %s", label, *refused, _off(label))
        return None
    recorder, refusal = None, []
    if settings is not None:
        try:
            recorder = _prepare(model, lm, inner, settings, boundaries, label, recorder_kw,
                                refusal.append if on_refused is not None else None)
        except Exception as e:  # never skip the agreement below: the other ranks wait in it
            why = f"could not set up the recording ({cause(e)}){bug_note(e)}"
            log.debug("eagle3_ops: %s: setting up the recording failed", label, exc_info=e)
            if on_refused is not None:
                refusal.append(why)
            else:
                log.error("eagle3_ops: %s: %s; %s", label, why, _off(label))
    from .groups import tp_group
    from .lockstep import all_ranks_agree

    if not all_ranks_agree(recorder is not None, tp_group()):  # a lone rank in the next-token all-gather would hang
        if recorder is not None:
            for h in recorder.handles:
                h.remove()
            refusal.append("another TP rank cannot record (see its log)")
            if on_refused is None:
                log.error("eagle3_ops: %s: another TP rank cannot record (see its log); %s", label, _off(label))
        if on_refused is not None:
            on_refused(refusal[0] if refusal else "its states cannot be recorded here")
        return None
    inner.__dict__[_STATE_ATTR] = recorder
    recorder.model = model
    _recorders.append(recorder)
    if atexit_write:  # the states dump: its file is written off the forward too, by a thread the interpreter
        recorder.background_write, recorder.writer_daemon = True, False  # joins before exit; unfilled: at exit
        atexit.register(recorder.write)
    return recorder


def _num_layers(inner) -> int:
    """The decoder's layer count: its config's, else its layers' (SGLang's GptOssModel keeps no config of its own;
    its ForCausalLM does)."""
    return int(getattr(getattr(inner, "config", None), "num_hidden_layers", len(inner.layers)))


def _prepare(model, lm, inner, settings: DumpSettings, boundaries: Optional[List[int]], label: str,
             recorder_kw: dict, refused=None) -> Optional[StatesRecorder]:
    """The recorder with its hooks registered (not yet active anywhere else), or None with one line (or, with
    ``refused``, the reason handed to it)."""
    from .groups import tp_rank_size

    tp_rank, tp_size = tp_rank_size()  # (0, 1) in a process without model-parallel groups
    num_layers = _num_layers(inner)
    start = getattr(inner, "start_layer", 0)
    end = getattr(inner, "end_layer", len(inner.layers))
    if boundaries is None:
        boundaries = needed_boundaries(inner.layers_to_capture, num_layers, settings.boundaries)
    recorder = StatesRecorder(lm, inner, settings, [], tp_rank, tp_size, label=label, **recorder_kw)
    unreachable = []
    for b in sorted(set(boundaries)):
        if b == num_layers and end == num_layers and getattr(inner, "norm", None) is not None:
            recorder.boundaries.append(b)
            continue
        if not (start <= b < end):
            unreachable.append(b)
            continue
        kind = _layer_capture_kind(inner.layers[b])
        if kind is None:
            unreachable.append(b)
            continue
        recorder.handles.append(inner.layers[b].register_forward_pre_hook(
            _layer_pre_hook(recorder, b, kind), with_kwargs=True))
        recorder.boundaries.append(b)
    recorder.unreachable = unreachable
    if not recorder.boundaries:
        if refused is not None:
            refused(f"no boundary of {type(model).__name__} can be recorded on this rank")
            return None
        log.warning("eagle3_ops: %s: no boundary of %s can be recorded on this rank; %s", label,
                    type(model).__name__, _off(label))
        return None
    itemsize = torch.empty((), dtype=next(inner.parameters()).dtype).element_size()
    # values, plus token ids and next tokens (int64 each) per token
    nbytes = settings.tokens * (len(recorder.boundaries) * recorder.hidden_size * itemsize + 16)
    recorder.max_bytes = nbytes
    problem = _room_problem(settings, nbytes, recorder.advice) if tp_rank == 0 else None  # rank 0 keeps values
    if problem is not None:
        for h in recorder.handles:
            h.remove()
        if refused is not None:
            refused(problem)
            return None
        log.error("eagle3_ops: %s=%s: %s; %s", label, settings.path, problem, _off(label))
        return None
    if label == ENV_DUMP_STATES:
        through = "" if settings.target == Path(os.path.abspath(settings.path)) else \
            f" (a symlink: the file written is {settings.target})"
        log.info("eagle3_ops: %s=%s%s: recording the first %d prefill tokens of %s at boundaries %s%s "
                 "(post all-reduce, TP rank %s keeps them: up to %.1f MiB host memory%s)", ENV_DUMP_STATES,
                 settings.path, through, settings.tokens, type(model).__name__, recorder.boundaries,
                 f", not reachable here: {unreachable}" if unreachable else "", 0,
                 nbytes / 2**20 if tp_rank == 0 else 0.0, _prefill_graph_note())
    return recorder


def _prefill_graph_note() -> str:
    sa = server_args()
    if sa is None or getattr(sa, "disable_prefill_cuda_graph", True) or getattr(sa, "disable_cuda_graph", False):
        return ""
    return "; prefill CUDA graphs are on: each prefill recorded runs eagerly instead (until the file is written)"


CAN_RUN_GRAPH_TARGET = ("sglang.srt.model_executor.runner.prefill_cuda_graph_runner."
                        "PrefillCudaGraphRunner.can_run_graph")


def around_can_run_graph(original, self, forward_batch, *args, **kwargs):
    """AROUND ``PrefillCudaGraphRunner.can_run_graph``: a prefill an unfinished recorder wants runs eagerly
    (a graph replay runs no Python). Not under DP attention (``global_num_tokens_cpu`` set), where the
    graph decision is a vote of the DP group and one rank alone leaving the graph would change the
    collectives' padding. After every recorder is written: one list check."""
    if _recorders and getattr(forward_batch, "global_num_tokens_cpu", None) is None:
        runner_model = getattr(getattr(self, "model_runner", None), "model", None)
        try:
            if any(not rec.done and (runner_model is None or rec.model is runner_model) and rec.wants(forward_batch)
                   for rec in _recorders):  # the recorded model's runner only (not the draft's)
                return False
        except Exception as e:  # never stop SGLang: the graph decides as stock
            global _graph_error_logged
            if not _graph_error_logged:
                _graph_error_logged = True
                log.error("eagle3_ops: could not read a batch for the recording (%s: %s); SGLang decides",
                          type(e).__name__, e)
    return original(self, forward_batch, *args, **kwargs)


_graph_error_logged = False


def dump_state(model) -> Optional[StatesRecorder]:
    """The states recorder installed on ``model`` (an SGLang target), or None."""
    _, inner = _recorded_modules(model)
    return inner.__dict__.get(_STATE_ATTR) if inner is not None else None


