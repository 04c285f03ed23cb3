"""STATES files: recorded target hidden states for ``doctor --replay``.

Two writers: the SGLang plugin's engine-side dump (``EAGLE3_OPS_DUMP_STATES=PATH``: the boundaries
replay needs, taken where SGLang captures, TP rank 0) writes ``eagle3_ops.doctor.states/2``;
``python -m eagle3_ops capture-states`` (Hugging Face transformers, every boundary) writes ``/1``.
:func:`read_states` reads both.

Format ``/2`` tensors, per recorded sequence ``i``:

- ``prompt.{i}.input_ids``      int64 [T]
- ``prompt.{i}.boundary.{b}``   [T, H]: boundary ``b`` = the residual stream entering layer ``b``
  (= Hugging Face ``output_hidden_states[b]`` for ``b < L``; ``b = 0`` the embeddings); boundary
  ``L`` is the last layer's output *before* the final norm (what engines capture)
- ``prompt.{i}.next_token``     int64 [T]: the target's greedy next token after position t

Metadata: ``format``, ``num_layers``, ``hidden_size``, ``boundaries`` (comma list: the boundaries
every sequence holds), ``num_prompts``, ``source`` and writer-specific keys.

Format ``/1`` (capture-states before this format) is still read: ``prompt.{i}.hidden_states``
[L+1, T, H] (index L after the final norm) and ``prompt.{i}.last_layer_output`` (boundary L).
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import torch

from .. import settings
from ..files import replace_atomically
from ..settings import SettingError

FORMAT = "eagle3_ops.doctor.states/2"
FORMAT_V1 = "eagle3_ops.doctor.states/1"

ENV_DUMP_STATES = "EAGLE3_OPS_DUMP_STATES"
ENV_DUMP_TOKENS = "EAGLE3_OPS_DUMP_TOKENS"
ENV_DUMP_BOUNDARIES = "EAGLE3_OPS_DUMP_BOUNDARIES"
DUMP_VARIABLES = (ENV_DUMP_STATES, ENV_DUMP_TOKENS, ENV_DUMP_BOUNDARIES)  # parsed by eagle3_ops.settings
DEFAULT_DUMP_TOKENS = 2048

StatesSettingError = SettingError  # a bad EAGLE3_OPS_DUMP_* value (the name older callers catch)


@dataclasses.dataclass(frozen=True)
class DumpSettings:
    """Where and what the engine-side states dump writes: the STATES path, the prefill tokens to record and which
    boundaries (``auto`` or ``all``)."""
    path: Path
    tokens: int = DEFAULT_DUMP_TOKENS
    boundaries: str = "auto"      # "auto" (configured +-1, embeddings, last) | "all"

    @classmethod
    def from_env(cls, env=None) -> Optional["DumpSettings"]:
        """None when the dump is off; raises SettingError (one line naming the variable) on a bad
        value, including a path that cannot take the file now (see settings.output_file_problem)."""
        path = settings.get(ENV_DUMP_STATES, env)
        if path is None:
            return None
        return cls(Path(path), settings.get(ENV_DUMP_TOKENS, env), settings.get(ENV_DUMP_BOUNDARIES, env))

    @property
    def target(self) -> Path:
        """The file that will be written: the path itself, or what it points to if it is a symlink."""
        return Path(os.path.realpath(self.path))


def needed_boundaries(layers_to_capture: Iterable[int], num_layers: int, mode: str = "auto") -> List[int]:
    """Boundaries the replay needs to score the candidate wirings: each configured boundary and its
    neighbours, the embeddings and the last layer's output (``mode='all'``: every boundary)."""
    L = int(num_layers)
    if mode == "all":
        return list(range(L + 1))
    out = {0, L}
    for b in layers_to_capture:
        out.update((int(b) - 1, int(b), int(b) + 1))
    return sorted(b for b in out if 0 <= b <= L)


def write_states(path, prompts: List[dict], *, num_layers: int, hidden_size: int, boundaries: List[int],
                 meta: Optional[Dict[str, str]] = None) -> dict:
    """Write ``prompts`` (each ``{"input_ids", "next_token", "boundaries": {b: [T, H]}}``) keeping the
    boundaries every prompt holds (:func:`save_states_file`). Returns {"out", "prompts", "tokens", "bytes"}."""
    common = set(boundaries)
    for p in prompts:
        common &= set(p["boundaries"])
    keep = sorted(common)
    tensors = {}
    total = 0
    for i, p in enumerate(prompts):
        tensors[f"prompt.{i}.input_ids"] = p["input_ids"].long().contiguous()
        tensors[f"prompt.{i}.next_token"] = p["next_token"].long().contiguous()
        for b in keep:
            tensors[f"prompt.{i}.boundary.{b}"] = p["boundaries"][b].contiguous()
        total += int(p["input_ids"].numel())
    info = {"format": FORMAT, "num_layers": str(int(num_layers)), "hidden_size": str(int(hidden_size)),
            "boundaries": ",".join(map(str, keep)), "num_prompts": str(len(prompts))}
    info.update({k: str(v) for k, v in (meta or {}).items()})
    out = save_states_file(tensors, path, info)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"out": str(out), "prompts": len(prompts), "tokens": total, "bytes": nbytes}


def _umask() -> int:
    try:  # read, not set: setting it (os.umask) would race other threads' file creation
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def save_states_file(tensors: Dict[str, torch.Tensor], path, metadata: Dict[str, str]) -> Path:
    """Write a safetensors file at ``path`` the way every STATES writer does: the target checked
    again now (settings.output_file_problem: a regular file or absent, never a directory, device,
    FIFO or socket; a symlink is written through), written to a fresh temporary file beside it,
    then renamed over it (a reader never sees half a file; a failed write, e.g. a full disk, leaves
    the old file and no temporary behind). Missing folders are created. Returns the file written."""
    from safetensors.torch import save_file

    problem = settings.output_file_problem(path, create_folders=True)
    if problem is not None:
        raise StatesError(f"not writing {path}: {problem}")
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)

    def write(tmp: str) -> None:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except Exception as e:  # safetensors reports I/O errors as SafetensorError("... (os error 28)")
            code = re.search(r"\(os error (\d+)\)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(target)) from e
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 -> what a plain open() would have made

    replace_atomically(target, write, suffix=".partial")
    return target


@dataclasses.dataclass
class StatesFile:
    """What replay needs from a STATES file (values as float32 on the CPU)."""
    path: Path
    num_layers: int
    hidden_size: int
    boundaries: List[int]              # boundaries every prompt holds
    prompts: List[dict]                # {"input_ids", "next_token" or None, "boundaries": {b: [T, H]}}
    source: str


class StatesError(Exception):
    """The file cannot be used (the message says why)."""


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_NUMBER = re.compile(r"[0-9]+")
_FIELDS = ("input_ids", "next_token", "hidden_states", "last_layer_output")
EXPECTED_NAMES = ("prompt.N.input_ids, prompt.N.next_token and prompt.N.boundary.B (format /2), or "
                  "prompt.N.hidden_states and prompt.N.last_layer_output (format /1)")


def _whole(text: str) -> Optional[int]:
    """``text`` as a whole number written the plain way (ASCII digits, no sign, no leading zero), else None."""
    if not _NUMBER.fullmatch(text) or (len(text) > 1 and text[0] == "0"):
        return None
    return int(text)


def _parse_name(p: Path, key: str):
    """(prompt index, field, boundary or None) of a STATES tensor name; StatesError naming it otherwise."""
    parts = key.split(".")
    if len(parts) < 3 or parts[0] != "prompt":
        raise StatesError(f"{p}: tensor {key!r} is not a STATES tensor (expected {EXPECTED_NAMES})")
    i = _whole(parts[1])
    if i is None:
        raise StatesError(f"{p}: tensor {key!r}: the prompt index {parts[1]!r} is not a whole number (expected "
                          f"prompt.N.<field> with N = 0, 1, 2, ...)")
    field = ".".join(parts[2:])
    if field in _FIELDS:
        return i, field, None
    if parts[2] == "boundary" and len(parts) == 4:
        b = _whole(parts[3])
        if b is None:
            raise StatesError(f"{p}: tensor {key!r}: the boundary {parts[3]!r} is not a whole number (expected "
                              f"prompt.N.boundary.B with B a layer boundary 0..L)")
        return i, "boundary", b
    raise StatesError(f"{p}: tensor {key!r} is not a STATES tensor (expected {EXPECTED_NAMES})")


def _meta_int(p: Path, meta: dict, key: str) -> Optional[int]:
    raw = meta.get(key)
    if raw is None:
        return None
    v = _whole(str(raw).strip())
    if v is None:
        raise StatesError(f"{p}: metadata {key}={raw!r} is not a whole number")
    return v


def _check_tensor(p: Path, key: str, t: torch.Tensor, shape, kind: str, why: str) -> None:
    """``t`` (tensor ``key``) has ``shape`` and a dtype of ``kind`` ("int" token ids, "float" hidden states)."""
    if tuple(t.shape) != tuple(shape):
        raise StatesError(f"{p}: tensor {key} has shape {list(t.shape)}, expected {list(shape)} ({why})")
    allowed = _INT_DTYPES if kind == "int" else _FLOAT_DTYPES
    if t.dtype not in allowed:
        words = "integer token ids (int64)" if kind == "int" else "floating-point hidden states (float32, bfloat16 " \
                                                                  "or float16)"
        raise StatesError(f"{p}: tensor {key} has dtype {str(t.dtype).replace('torch.', '')}, expected {words}")
    if kind == "int" and t.numel() and int(t.min()) < 0:
        raise StatesError(f"{p}: tensor {key} holds token id {int(t.min())}, expected ids >= 0")


def read_states(path, *, num_layers: int, hidden_size: int, vocab_size: Optional[int] = None) -> StatesFile:
    """Read a STATES file, checked against its format before anything is used: tensor names (prompt.N.field with
    whole-number N and B), the prompt indices (0..N-1, each with its input_ids), shapes (input_ids [T], next_token
    [T] like its input_ids, boundary.B [T, H] for B in 0..L, hidden_states [L+1, T, H]), dtypes (integer ids,
    floating-point states), token ids (>= 0, below ``vocab_size`` where given), finite values, and the metadata
    (format, num_layers, hidden_size, boundaries, num_prompts). A fault raises StatesError naming the file, the
    tensor or field, and what was expected."""
    p = Path(path)
    try:
        from safetensors import safe_open

        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            keys = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as e:
        raise StatesError(f"cannot read {p} as safetensors: {e}") from None
    fmt = meta.get("format")
    if fmt not in (None, FORMAT, FORMAT_V1):
        raise StatesError(f"{p} has format {fmt!r}, expected {FORMAT!r}")
    L, H = int(num_layers), int(hidden_size)
    got_l, got_h = _meta_int(p, meta, "num_layers"), _meta_int(p, meta, "hidden_size")
    if got_l not in (None, L) or got_h not in (None, H):
        raise StatesError(f"{p} was recorded from a model with {meta.get('num_layers')} layers and hidden size "
                          f"{meta.get('hidden_size')}; the target has {L} and {H} (states from another model?)")
    by_prompt: Dict[int, Dict[str, object]] = {}
    for k in sorted(keys):
        i, field, b = _parse_name(p, k)
        entry = by_prompt.setdefault(i, {"boundaries": {}})
        if field == "boundary":
            if not 0 <= b <= L:
                raise StatesError(f"{p}: tensor {k}: boundary {b} does not exist (expected 0..{L}: the target has {L} "
                                  f"layers; states from another model?)")
            entry["boundaries"][b] = k
        else:
            entry[field] = k
    if not by_prompt:
        raise StatesError(f"{p} holds no prompt.N.input_ids tensors (make it with capture-states or the SGLang "
                          f"plugin's {ENV_DUMP_STATES})")
    idx = sorted(by_prompt)
    for i in idx:
        if "input_ids" not in by_prompt[i]:
            held = sorted(k for k in keys if k.startswith(f"prompt.{i}."))
            raise StatesError(f"{p}: prompt {i} has tensors ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}) "
                              f"but no prompt.{i}.input_ids")
    if idx != list(range(len(idx))):
        # the first missing index, found without a range as large as the largest index (an index in a file is
        # untrusted: prompt.999999999999 alone must not allocate a trillion of anything)
        first_gap = next(n for n, i in enumerate(idx) if i != n)
        raise StatesError(f"{p}: the prompt indices are {idx[:8]}{' ...' if len(idx) > 8 else ''}, expected 0.."
                          f"{len(idx) - 1} (missing prompt.{first_gap}.input_ids)")
    n_meta = _meta_int(p, meta, "num_prompts")
    if n_meta is not None and n_meta != len(idx):
        raise StatesError(f"{p}: metadata num_prompts={n_meta}, but the file holds {len(idx)} prompts (prompt.0.."
                          f"prompt.{len(idx) - 1})")
    listed = None
    if (meta.get("boundaries") or "").strip():
        listed = []
        for x in meta["boundaries"].split(","):
            b = _whole(x.strip())
            if b is None or b > L:
                raise StatesError(f"{p}: metadata boundaries={meta['boundaries']!r}: {x.strip()!r} is not a boundary "
                                  f"0..{L}")
            listed.append(b)
    prompts = []
    for i in idx:
        e = by_prompt[i]
        ids_key = e["input_ids"]
        ids = tensors[ids_key]
        if ids.dim() != 1 or ids.numel() == 0:
            raise StatesError(f"{p}: tensor {ids_key} has shape {list(ids.shape)}, expected [T] with T >= 1 (the "
                              f"prompt's token ids)")
        T = ids.numel()
        _check_tensor(p, ids_key, ids, (T,), "int", "the prompt's token ids")
        got: Dict[int, torch.Tensor] = {}
        hs_key = e.get("hidden_states")
        if hs_key is not None:  # format /1: every boundary; index L is after the final norm
            hs = tensors[hs_key]
            _check_tensor(p, hs_key, hs, (L + 1, T, H), "float",
                          f"boundaries 0..{L} x the {T} tokens of {ids_key} x hidden {H}; states from another model?")
            got = {b: hs[b] for b in range(L)}
            got[L] = hs[L]
        last_key = e.get("last_layer_output")
        if last_key is not None:
            _check_tensor(p, last_key, tensors[last_key], (T, H), "float",
                          f"the {T} tokens of {ids_key} x hidden {H}")
            got[L] = tensors[last_key]
        for b, k in sorted(e["boundaries"].items()):
            _check_tensor(p, k, tensors[k], (T, H), "float",
                          f"the {T} tokens of {ids_key} x hidden {H}; states from another model?")
            got[b] = tensors[k]
        if not got:
            raise StatesError(f"{p}: prompt {i} has input_ids but no hidden states (expected prompt.{i}.boundary.B or "
                              f"prompt.{i}.hidden_states)")
        if listed is not None and fmt == FORMAT:
            lacking = [b for b in listed if b not in got]
            if lacking:
                raise StatesError(f"{p}: prompt {i} has no prompt.{i}.boundary.{lacking[0]}, which the metadata "
                                  f"boundaries={meta['boundaries']!r} say every prompt holds")
        values = {}
        for b, t in got.items():
            v = t.float()
            if not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                raise StatesError(f"states file {p} holds non-finite values in prompt {i} (boundary {b}: {bad} of "
                                  f"{v.numel()} NaN/inf); record it again (float16 overflows in large models: use "
                                  f"--dtype bfloat16 or float32)")
            values[b] = v
        nxt = None
        nxt_key = e.get("next_token")
        if nxt_key is not None:
            nxt = tensors[nxt_key]
            _check_tensor(p, nxt_key, nxt, (T,), "int", f"the target's next token after each of the {T} tokens of "
                                                        f"{ids_key}")
            nxt = nxt.long()
        ids = ids.long()
        if vocab_size is not None:
            for key, t in ((ids_key, ids), (nxt_key, nxt)):
                if t is not None and t.numel() and int(t.max()) >= int(vocab_size):
                    raise StatesError(f"{p}: tensor {key} holds token id {int(t.max())}, expected ids below the "
                                      f"target's vocabulary size {vocab_size} (states from another model?)")
        prompts.append({"input_ids": ids, "next_token": nxt, "boundaries": values})
    common = set(prompts[0]["boundaries"])
    for pr in prompts[1:]:
        common &= set(pr["boundaries"])
    if not common:
        raise StatesError(f"{p}: no boundary is held by every prompt")
    source = meta.get("source", "capture-states (Hugging Face)" if fmt != FORMAT else "unknown")
    return StatesFile(p, L, H, sorted(common), prompts, source)
