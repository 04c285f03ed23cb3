"""The doctor's part of the live check at start-up: where the draft checkpoint is (:func:`locate_draft`), the
doctor's report on the configs as this server serves them (:func:`doctor_report`, with the server's pipeline
layout, :func:`pipeline`, and context length), whether this process is an EAGLE-3 server at all
(:func:`eagle3_server`), and why the replay cannot score the draft, known before anything is recorded
(:func:`cannot_replay`)."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import List, Optional

from ..doctor import checks, codes, configs
from ..doctor.replay import draft_implementation, unsupported_draft
from ..files import os_error_words
from .dump_states import server_args


def eagle3_server():
    """SGLang's server args where this process is an EAGLE-3 server, else None (a script, another algorithm)."""
    sa = server_args()
    return sa if sa is not None and str(getattr(sa, "speculative_algorithm", "") or "").upper() == "EAGLE3" else None


def find_draft_dir(draft_path) -> Optional[Path]:
    """The draft checkpoint's local folder: the path itself, or the Hugging Face cache's snapshot of it."""
    return locate_draft(draft_path)[0]


def locate_draft(draft_path):
    """(the draft checkpoint's local folder, None) or (None, why not): the path itself, or the Hugging Face
    cache's snapshot of it; where the path is there but cannot be used (a dangling symlink, a symlink loop, a
    folder above it that cannot be searched, a file), the OS error's name and the path."""
    if draft_path is None:
        return None, "the server names no draft checkpoint"
    p = Path(str(draft_path)).expanduser()
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        if os.path.islink(p):
            try:
                return None, (f"the draft checkpoint {p} is a dangling symlink (-> {os.readlink(p)}): what it points "
                              f"to does not exist (ENOENT)")
            except OSError:
                pass
        mode = None
    except NotADirectoryError as e:
        return None, f"the draft checkpoint {p} cannot be reached: {os_error_words(e)} (a part of the path is a file)"
    except OSError as e:  # EACCES (a folder above it that cannot be searched), ELOOP, ENAMETOOLONG, EIO
        hint = (" (the server's user needs search (x) permission on every folder above it)"
                if getattr(e, "errno", None) in (errno.EACCES, errno.EPERM) else "")
        return None, f"the draft checkpoint {p} cannot be reached: {os_error_words(e)}{hint}"
    if mode is not None:
        if stat.S_ISDIR(mode):
            return p, None
        return None, f"the draft checkpoint {p} is a file, not a folder (SGLang loads a checkpoint folder)"
    found = configs.hf_cached_snapshot(str(draft_path))
    if found is not None:
        return found, None
    return None, f"the draft checkpoint {str(draft_path)!r} is not a local folder (nor in the Hugging Face cache)"


def doctor_report(target_config, draft_dir: Path, tp_size: int, pp_size: int = 1,
                  pp_partition: Optional[List[int]] = None, snapshot: Optional[dict] = None):
    """(the doctor's config report, the draft's weight headers); ``snapshot`` (doctor.configs.draft_snapshot):
    the draft read from it (its config as read then, its weight files and nothing else)."""
    target = configs.target_from_config(target_config, use_sglang=True)
    if snapshot is not None:
        draft = configs.draft_from_config(snapshot["config"], snapshot["dir"], use_sglang=True)
        weights = configs.read_weight_headers(draft_dir, files=configs.snapshot_weight_files(snapshot))
    else:
        draft = configs.parse_draft(draft_dir, use_sglang=True)
        weights = configs.read_weight_headers(draft_dir)
    served = getattr(server_args(), "context_length", None)  # None: the target's own length
    report = checks.run_checks(target, draft, weights, checks.Options(
        engine="sglang", tp=tp_size, pp=pp_size, pp_partition=pp_partition, engine_code="installed",
        server_running=True, served_context_length=served if isinstance(served, int) else None))
    return report, weights


def pipeline() -> tuple:
    """(pp size, SGLANG_PP_LAYER_PARTITION as a list or None) of this server: where the doctor's pipeline rule
    (only the last stage captures) applies."""
    pp = getattr(server_args(), "pp_size", 1)
    pp = pp if isinstance(pp, int) and pp > 0 else 1
    raw = os.environ.get("SGLANG_PP_LAYER_PARTITION", "").strip()
    try:
        partition = [int(x) for x in raw.split(",")] if raw and pp > 1 else None
    except ValueError:
        partition = None
    return pp, partition if partition and len(partition) == pp else None


def cannot_replay(report, weights) -> Optional[str]:
    """Why the replay cannot score this draft (known from the configs, before anything is recorded)."""
    if report.wiring is None or report.training is None:
        return ("the doctor finds no wiring SGLang would serve (see its errors: "
                + ", ".join(f.code for f in report.findings if f.severity == "error") + ")"
                if report.draft.use_aux_hidden_state else "the draft uses no aux hidden states")
    wrong_class = report.find(codes.E_DRAFT_CLASS)
    if wrong_class is not None:  # SGLang serves such a draft with parameters unset: nothing trained to score
        return f"the draft's class does not fit its checkpoint ({wrong_class.code}: {wrong_class.text})"
    return unsupported_draft(report.draft, weights, draft_implementation("sglang"))  # what the replay child runs
