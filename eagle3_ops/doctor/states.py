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


def read_states(path, *, num_layers: int, hidden_size: int) -> StatesFile:
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
    if meta.get("num_layers") not in (None, str(L)) or meta.get("hidden_size") not in (None, str(H)):
        raise StatesError(f"{p} was recorded from a model with {meta.get('num_layers')} layers and hidden size "
                          f"{meta.get('hidden_size')}; the target has {L} and {H} (states from another model?)")
    idx = sorted({int(k.split(".")[1]) for k in keys if k.startswith("prompt.") and k.endswith(".input_ids")})
    if not idx:
        raise StatesError(f"{p} holds no prompt.N.input_ids tensors (make it with capture-states or the SGLang "
                          f"plugin's {ENV_DUMP_STATES})")
    prompts = []
    for i in idx:
        ids = tensors[f"prompt.{i}.input_ids"].long().reshape(-1)
        T = ids.numel()
        got: Dict[int, torch.Tensor] = {}
        hs = tensors.get(f"prompt.{i}.hidden_states")
        if hs is not None:  # format /1: every boundary; index L is after the final norm
            if hs.dim() != 3 or hs.shape[0] != L + 1 or hs.shape[1] != T or hs.shape[2] != H:
                raise StatesError(f"prompt {i} hidden_states has shape {list(hs.shape)}; the target needs "
                                  f"[{L + 1}, {T}, {H}] (states from another model?)")
            got = {b: hs[b] for b in range(L)}
            last = tensors.get(f"prompt.{i}.last_layer_output")
            got[L] = last if last is not None else hs[L]
        prefix = f"prompt.{i}.boundary."
        for k in keys:
            if k.startswith(prefix):
                b = int(k[len(prefix):])
                t = tensors[k]
                if t.dim() != 2 or t.shape != (T, H) or not 0 <= b <= L:
                    raise StatesError(f"prompt {i} boundary {b} has shape {list(t.shape)}; the target needs "
                                      f"[{T}, {H}] for boundaries 0..{L} (states from another model?)")
                got[b] = t
        if not got:
            raise StatesError(f"prompt {i} has input_ids but no hidden states")
        values = {}
        for b, t in got.items():
            v = t.float()
            if not bool(torch.isfinite(v).all()):
                bad = int((~torch.isfinite(v)).sum())
                raise StatesError(f"states file {p} holds non-finite values in prompt {i} (boundary {b}: {bad} of "
                                  f"{v.numel()} NaN/inf); record it again (float16 overflows in large models: use "
                                  f"--dtype bfloat16 or float32)")
            values[b] = v
        nxt = tensors.get(f"prompt.{i}.next_token")
        prompts.append({"input_ids": ids, "next_token": nxt.long().reshape(-1) if nxt is not None else None,
                        "boundaries": values})
    common = set(prompts[0]["boundaries"])
    for pr in prompts[1:]:
        common &= set(pr["boundaries"])
    if not common:
        raise StatesError(f"{p}: no boundary is held by every prompt")
    source = meta.get("source", "capture-states (Hugging Face)" if fmt != FORMAT else "unknown")
    return StatesFile(p, L, H, sorted(common), prompts, source)

