"""What both hook modules (capture_hooks.py, draft_fc_hooks.py) need from the serving process: the
backends that serve a site (one policy for a forced backend that cannot), warn-once log lines, and the
row budget read from SGLang's server args (the most tokens one target forward can capture, the largest
decode CUDA-graph batch).
"""
from __future__ import annotations

import logging
from typing import Dict, Optional

import torch

from .. import dispatch

log = logging.getLogger("eagle3_ops.sglang")
_warned: set = set()


def warn_once(key: str, msg: str, *args) -> None:
    """``log.warning(msg, *args)`` the first time ``key`` is seen in this process, nothing after (one line per problem,
    not per forward)."""
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def info_once(key: str, msg: str, *args) -> None:
    """``log.info(msg, *args)`` the first time ``key`` is seen in this process (keys shared with :func:`warn_once`)."""
    if key not in _warned:
        _warned.add(key)
        log.info(msg, *args)


def serving_backends(ops_needed, device: torch.device, dtype: torch.dtype, site: str) -> Optional[Dict[str, str]]:
    """{op: backend} for the ops a site needs, or None (one warning) when they cannot be served:
    the one policy of both sides for a forced ``EAGLE3_OPS_BACKEND`` that cannot serve this device
    (or an invalid value). The site is then left stock, untouched: the op raising later inside a
    forward would stop SGLang, and quietly using another backend is what forcing one rules out."""
    try:
        return {op: dispatch.select(op, device, dtype)[0] for op in ops_needed}
    except (dispatch.BackendUnavailableError, ValueError) as e:
        warn_once(f"backend:{site}:{e}", "eagle3_ops: %s left stock: %s", site, e)
        return None


def decode_graph_rows(sa) -> int:
    """The largest decode/verify CUDA-graph batch (requests): SGLang 0.5.23 keeps it in
    ``cuda_graph_config.decode`` (``bs``, the captured sizes, and ``max_bs``), published in the exec
    namespace once the server resolved it, and in the server args before."""
    configs = []
    try:
        from sglang.srt.runtime_context import get_exec

        configs.append(get_exec().graph.cuda_graph_config)
    except Exception:  # not published (scripts, tests)
        pass
    configs.append(getattr(sa, "cuda_graph_config", None))
    for cfg in configs:
        decode = getattr(cfg, "decode", None) if cfg is not None else None
        if decode is None and isinstance(cfg, dict):
            decode = cfg.get("decode")
        if decode is None:
            continue
        # called only within this iteration (and with positional args), so the late binding is harmless
        get = decode.get if isinstance(decode, dict) else (lambda k, d=None: getattr(decode, k, d))  # noqa: B023
        sizes = [int(b) for b in (get("bs") or []) if isinstance(b, int)]
        max_bs = get("max_bs")
        best = max(sizes + ([int(max_bs)] if isinstance(max_bs, int) else []), default=0)
        if best:
            return best
    return 0


def default_max_tokens() -> int:
    """Rows of the buffer when EAGLE3_OPS_SGLANG_MAX_TOKENS is unset: the most tokens one target forward
    of this server can capture: SGLang's chunked_prefill_size (else max_prefill_tokens, else 16384),
    and at least the largest decode/verify CUDA-graph batch, or the most running requests, times the
    draft tokens per request (a verify forward's rows)."""
    candidates = []
    try:
        from sglang.srt.runtime_context import get_server_args

        sa = get_server_args()
        chunk = getattr(sa, "chunked_prefill_size", None)
        if isinstance(chunk, int) and chunk > 0:
            candidates.append(chunk)
        else:
            candidates.append(int(getattr(sa, "max_prefill_tokens", None) or 16384))
        draft_tokens = int(getattr(sa, "speculative_num_draft_tokens", None) or 1)
        requests = max(decode_graph_rows(sa), int(getattr(sa, "max_running_requests", None) or 0))
        if requests:
            candidates.append(requests * draft_tokens)
    except Exception:  # no server args published (scripts, the CPU harness)
        pass
    return max(candidates) if candidates else 16384
