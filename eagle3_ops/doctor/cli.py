"""``python -m eagle3_ops doctor`` and ``python -m eagle3_ops capture-states``.

Exit status: 0 = no error finding, 1 = at least one error finding, 2 = bad usage (argparse's usage
and the error) or unreadable input (one clear line on stderr, no traceback; ``EAGLE3_OPS_DEBUG=1``
re-raises unexpected errors), 3 = out of memory or disk, 130 = interrupted, 141 = stdout closed by
its reader (eagle3_ops/_cli.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import logging
import os
import re
import sys
import textwrap
from typing import List, Optional

from .. import _cli
from .configs import CONVENTIONS, DoctorInputError
from .rules import ENGINE_CODE_CHOICES

DOCTOR_DESCRIPTION = """\
Check which hidden states an inference engine feeds an EAGLE-3 draft, and whether they are the
ones the draft was trained on. Reads both config.json files and the draft's safetensors headers
(never all weights). With --replay, also runs the draft's first step on recorded target states
for the configured and candidate wirings and compares their next-token accuracy.

"Boundary i" = Hugging Face output_hidden_states[i] = the residual stream entering decoder layer i
(layers count from 0) = the output of layer i-1; boundary 0 = token embeddings.
"""


class _UsageError(Exception):
    def __init__(self, message: str, usage: str = ""):
        super().__init__(message)
        self.usage = usage  # argparse's usage, printed first for a command line it could not parse


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # never exit from inside the library; report and return 2
        """Raises _UsageError with the message and argparse's usage instead of exiting (the caller prints them and
        returns exit status 2)."""
        raise _UsageError(f"{self.prog}: {message}", self.format_usage())


def _ids(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


# Options whose value may start with '-' (``--trained-ids -1,4,6``): argparse would read such a value as an
# option, so it is attached with '=' before parsing (``--trained-ids=-1,4,6`` works as is).
_INT_LIST_OPTIONS = ("--trained-ids", "--pp-partition", "--trtllm-layers")
_INT_LIST = re.compile(r"^\s*-\d+\s*(,\s*-?\d+\s*)*,?\s*$")


def _join_negative_lists(argv: List[str]) -> List[str]:
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return out + argv[i:]
        if a in _INT_LIST_OPTIONS and i + 1 < len(argv) and _INT_LIST.match(argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def _doctor_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m eagle3_ops doctor", description=DOCTOR_DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, metavar="DRAFT_DIR",
                   help="EAGLE-3 draft checkpoint directory, or its Hugging Face id when it is in the local cache")
    p.add_argument("--target", required=True, metavar="TARGET_DIR",
                   help="target model directory (config.json), or its Hugging Face id when it is in the local cache")
    p.add_argument("--engine", choices=("sglang", "vllm", "trtllm"), default="sglang",
                   help="serving engine whose id rules apply (default: sglang)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size of the target")
    p.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel size of the target")
    p.add_argument("--pp-partition", type=_ids, default=None, metavar="N,N,..",
                   help="layers per pipeline stage (SGLANG_PP_LAYER_PARTITION), default: even split")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of tables")
    p.add_argument("--replay", metavar="STATES", help="safetensors file from capture-states or the SGLang plugin: "
                                                      "search every recorded boundary in every slot for the wiring "
                                                      "the draft predicts the target best with (the live check's "
                                                      "search and verdict)")
    p.add_argument("--replay-margin", type=float, default=0.02, metavar="F",
                   help="accuracy gain (absolute) another wiring needs to be reported as an error (default 0.02)")
    p.add_argument("--replay-sweep", action="store_true",
                   help="also score every single-slot change of the served wiring on every position (K x (L+1) "
                        "full runs: a slower cross-check of the search, which scans them on fewer positions)")
    p.add_argument("--replay-max-tokens", type=int, default=4096, metavar="N", help="positions scored (default 4096)")
    p.add_argument("--replay-steps", type=int, default=1, metavar="S",
                   help="also score the served wiring's draft steps 2..S, the draft fed its own outputs as SGLang's "
                        "EAGLE worker feeds it (needs --replay-draft sglang or auto with SGLang installed; default 1: "
                        "the first step only)")
    p.add_argument("--device", default="cpu", help="device for --replay (default cpu)")
    p.add_argument("--replay-draft", choices=("auto", "sglang", "plain"), default="auto",
                   help="what runs the draft in --replay: sglang = SGLang's own EAGLE-3 head class (any head SGLang "
                        "serves; CPU); plain = the plain-PyTorch llama_eagle3 twin (no SGLang needed; "
                        "LlamaForCausalLMEagle3 drafts only); auto (default) = sglang with --engine sglang where the "
                        "pinned SGLang is installed and --device is cpu, else plain")
    p.add_argument("--trained-convention", choices=("auto",) + CONVENTIONS, default="auto",
                   help="how the draft's ids were read during training: layer-output = 'output of layer k' "
                        "(SpecForge/SGLang), layer-input = 'entering layer k' (vLLM/speculators); "
                        "auto: from the config dialect")
    p.add_argument("--trained-ids", type=_ids, default=None, metavar="N,N,..",
                   help="ids the draft was actually trained with, if its config.json was edited since")
    p.add_argument("--vllm-runner", choices=("v2", "v1"), default="v2",
                   help="with --engine vllm: vLLM 0.33.0's model runner. v2 (default) reads only the top-level ids; "
                        "v1 (VLLM_USE_V2_MODEL_RUNNER=0, or P-EAGLE parallel drafting) falls back to eagle_config's")
    p.add_argument("--trtllm-layers", type=_ids, default=None, metavar="N,N,..",
                   help="with --engine trtllm: the eagle3_layers_to_capture you pass to TensorRT-LLM (it never reads "
                        "the draft config's ids); default: none passed, TensorRT-LLM's default (1, L//2-1, L-4)")
    p.add_argument("--engine-code", choices=ENGINE_CODE_CHOICES, default="auto",
                   help="where SGLang's rules come from: auto (default) = the installed SGLang when it is the pinned "
                        "version, else the pinned table; installed = the installed SGLang whatever its version; "
                        "table = the pinned table (fast: imports no SGLang)")
    p.add_argument("--draft-snapshot", default=None, metavar="FILE",
                   help="a snapshot of DRAFT_DIR (JSON) the live wiring check wrote at server start-up: the draft "
                        "config is read from it instead of DRAFT_DIR/config.json, and the weight files it lists are "
                        "the ones read, refused if they changed since")
    p.add_argument("--capture-point", choices=("auto", "after-allreduce", "before-allreduce"), default="auto",
                   help="where captures are taken relative to the TP all-reduce (for custom capture hooks); "
                        "auto: the engine's stock path")
    return p


def _capture_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m eagle3_ops capture-states",
                description="Record a target's hidden states at every layer boundary with Hugging Face "
                            "transformers, for `doctor --replay`.")
    p.add_argument("--model", required=True, metavar="TARGET_DIR",
                   help="target model directory, or its Hugging Face id when it is in the local cache")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="JSON list of strings or token-id lists, or text with one prompt per line (default: "
                        "24 built-in plain-text prompts, tokenized with the model's tokenizer)")
    p.add_argument("--out", required=True, metavar="STATES.safetensors")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                   help="dtype the model runs and the states are stored in (default bfloat16)")
    p.add_argument("--max-tokens", type=int, default=512, metavar="N", help="tokens kept per prompt")
    p.add_argument("--device", default=None, help="device the model runs on (default cpu)")
    p.add_argument("--device-map", default=None, metavar="MAP",
                   help="passed to from_pretrained as device_map (e.g. auto) to spread a large model over "
                        "devices; needs accelerate; replaces --device")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the model's own code (config.json auto_map); only for checkpoints you trust")
    return p


def _parse(parser, argv):
    try:
        return parser.parse_args(argv)
    except SystemExit as e:  # --help
        raise _Exit(int(e.code or 0)) from None


class _Exit(Exception):
    def __init__(self, code):
        self.code = code


def _guard(fn, argv) -> int:
    return _cli.run(functools.partial(_one_line_errors, fn), argv)


def _one_line_errors(fn, argv) -> int:
    try:
        return fn(argv)
    except _Exit as e:
        return e.code
    except (_UsageError, DoctorInputError) as e:
        print(f"{getattr(e, 'usage', '')}error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # unreadable input of a kind not foreseen: still no traceback
        if isinstance(e, BrokenPipeError) or _cli.resource_failure(e) is not None:
            raise  # _cli.run: a closed stdout ends quietly (141), a resource failure is one line (3)
        from .. import settings

        if settings.get_or_default("EAGLE3_OPS_DEBUG", logging.getLogger("eagle3_ops")):
            raise
        print(f"error: {type(e).__name__}: {e} (set EAGLE3_OPS_DEBUG=1 for a traceback)", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------------- doctor
def main(argv: Optional[List[str]] = None) -> int:
    """``python -m eagle3_ops doctor ...``; returns the exit status."""
    return _guard(_doctor, list(sys.argv[1:] if argv is None else argv))


def _check_numbers(args) -> None:
    """Numeric options, before any file is read."""
    if args.tp < 1:
        raise _UsageError(f"--tp must be >= 1, got {args.tp}")
    if args.pp < 1:
        raise _UsageError(f"--pp must be >= 1, got {args.pp}")
    if args.replay_max_tokens < 1:
        raise _UsageError(f"--replay-max-tokens must be >= 1, got {args.replay_max_tokens}")
    m = args.replay_margin
    if not math.isfinite(m) or not 0 <= m < 1:  # an absolute gain in top-1 accuracy; nan would never fire
        raise _UsageError(f"--replay-margin must be an accuracy gain in [0, 1), e.g. 0.02, got {m}")


def build_report(args):
    """The doctor's :class:`checks.Report` for parsed ``args``: reads the target, the draft (or the server's start-up
    snapshot) and the weight headers, runs the checks, then ``--replay`` when asked. Raises DoctorInputError or
    _UsageError for bad inputs."""
    from .checks import Options, run_checks
    from .configs import checkpoint_files, parse_draft, parse_target, read_weight_headers, resolve_model_dir
    from .rules import sglang_source

    _check_numbers(args)
    args.target = str(resolve_model_dir(args.target, "target"))  # a folder, or a Hugging Face id in the cache
    args.draft = str(resolve_model_dir(args.draft, "draft"))
    source = sglang_source(args.engine_code)[0]
    use_sglang = source in ("live", "kept")  # SGLang's parser, run now or as it read these configs before
    target = parse_target(args.target, use_sglang=use_sglang)
    snapshot = None
    if getattr(args, "draft_snapshot", None):  # the live check: the draft as the server read it at start-up
        from .configs import changed_since_start, draft_from_config, read_snapshot, snapshot_changes

        snapshot = read_snapshot(args.draft_snapshot, args.draft)
        changes = snapshot_changes(snapshot, roles=("index", "weights"))
        if changes:
            raise DoctorInputError(changed_since_start(snapshot, changes))
        draft = draft_from_config(snapshot["config"], snapshot["dir"], use_sglang=use_sglang)
    else:
        draft = parse_draft(args.draft, use_sglang=use_sglang)
    if args.pp > target.num_layers:
        raise _UsageError(f"--pp {args.pp} exceeds the target's {target.num_layers} layers")
    if args.pp_partition is not None:
        if len(args.pp_partition) != args.pp or sum(args.pp_partition) != target.num_layers \
                or min(args.pp_partition) < 1:
            raise _UsageError(f"--pp-partition {args.pp_partition} must list {args.pp} positive layer counts "
                              f"summing to {target.num_layers}")
    if snapshot is not None:
        from .configs import snapshot_weight_files

        weights = read_weight_headers(draft.path, files=snapshot_weight_files(snapshot))
    elif not checkpoint_files(draft.path).files:  # configs only: every check they allow, the others named
        if args.replay:
            raise DoctorInputError(f"draft: --replay runs the draft, and {draft.path} holds no weights (expected "
                                   f"model.safetensors, sharded *.safetensors with an index, or pytorch_model.bin); "
                                   f"without --replay the doctor checks the configs alone")
        weights = None
    else:
        weights = read_weight_headers(draft.path)
    opts = Options(engine=args.engine, tp=args.tp, pp=args.pp, pp_partition=args.pp_partition,
                   trained_convention=args.trained_convention, trained_ids=args.trained_ids,
                   vllm_runner=args.vllm_runner, trtllm_layers=args.trtllm_layers,
                   capture_point=args.capture_point, engine_code=args.engine_code)
    report = run_checks(target, draft, weights, opts)
    if args.replay:
        from .replay import run_replay

        run_replay(report, weights, args.replay, margin=args.replay_margin, max_tokens=args.replay_max_tokens,
                   device=args.device, sweep=args.replay_sweep, draft_code=args.replay_draft,
                   chain_steps=args.replay_steps)
    if snapshot is not None:  # read while it changed: what was scored is not what the server loaded
        changes = snapshot_changes(snapshot, roles=("index", "weights"))
        if changes:
            raise DoctorInputError(changed_since_start(snapshot, changes))
    if source == "live" and args.engine_code == "auto":  # SGLang's registry is loaded: keep what it says
        from . import engine_cache

        engine_cache.keep_table()
    return report


def _doctor(argv) -> int:
    args = _parse(_doctor_parser(), _join_negative_lists(argv))
    report = build_report(args)
    print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1  # `doctor ... | head`: _cli.run sees the closed pipe


def _table(rows: List[List[str]], headers: List[str]) -> str:
    try:
        from tabulate import tabulate

        return tabulate(rows, headers=headers, tablefmt="simple")
    except ImportError:
        widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
        line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
        return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _wrap(text: str, indent: str) -> str:
    return textwrap.fill(text, width=110, initial_indent=indent, subsequent_indent=indent + "  ")


def format_report(report) -> str:
    """``report`` as the text the doctor prints: target, draft, engine rules and training lines, the slot table, the
    replay results, the findings (errors first) and the result line."""
    from .engines import ENGINE_NAMES

    t, d, o = report.target, report.draft, report.options
    eng = ENGINE_NAMES[o.engine]
    L = t.num_layers
    out = ["EAGLE-3 wiring doctor", _wrap(f"target : {t.path}  ({t.describe()})", "  "),
           _wrap(f"draft  : {d.path}  ({d.describe()})", "  ")]
    r = report.rules
    if r is not None:
        cls = r.class_name.rsplit(".", 1)[-1] or r.arch or "no class"
        state = {True: "serves EAGLE-3", False: "REFUSES EAGLE-3", None: "EAGLE-3 support unknown"}[r.supported]
        out.append(_wrap(f"class  : {eng} {r.version} -> {cls} ({state}); rules from {r.source}", "  "))
    if report.wiring is not None:
        w = report.wiring
        ids = f"ids {w.ids} from {w.ids_source}" if w.ids is not None else \
            f"no ids: {w.ids_source} = boundaries {w.config_order}"
        out.append(_wrap(f"engine : {eng}, tp={o.tp}, pp={o.pp}; {eng} rule: boundary = {w.rules.rule_text}; {ids}",
                         "  "))
    if report.training is not None:
        out.append(_wrap(f"trained: {report.training.source}", "  "))
        for n, r in enumerate(report.training.readings):
            state = "" if r.plausible else f"  [ruled out: {r.why_not}]"
            out.append(_wrap(f"reading {chr(ord('A') + n)}: {r.boundaries} if {r.label}{state}", "    "))
    if report.slots:
        out.append("")
        out.append(_wrap(f"How to read the table: layers count from 0 to {L - 1}. Boundary i is the residual stream "
                         f"entering layer i, which is the output of layer i-1 (Hugging Face output_hidden_states[i]); "
                         f"boundary 0 is the token embeddings, boundary {L} the output of the last layer.", "  "))
        rows = []
        for s in report.slots:
            cid = "default" if s["config_id"] is None and s["capture_index"] is not None else \
                ("-" if s["config_id"] is None else str(s["config_id"]))
            cap = "-" if s["capture_index"] is None else str(s["capture_index"])
            per = s.get("trained_by_reading") or {}
            letters = {r.key: chr(ord("A") + n) for n, r in enumerate(report.training.readings)} \
                if report.training is not None else {}
            if s["trained_index"] is not None:
                trained = str(s["trained_index"])
            else:
                trained = " ".join(f"{letters.get(k, k)}:{v}" for k, v in per.items()) or "-"
            trained_on = "(same)" if s["match"] else s["draft_trained_on"]
            ok = "yes" if s["match"] else ("NO" if not any(v == s["capture_index"] for v in per.values()) else
                                          "depends")
            rows.append([s["slot"], cid, cap, s["engine_reads"], trained, trained_on, ok])
        out.append("")
        out.append(_table(rows, ["slot", "id", f"{eng} boundary", f"what {eng} feeds the draft",
                                 "trained", "what the draft was trained on", "ok"]))
    if report.replay is not None:
        r = report.replay
        out.append("")
        out.append(_wrap(f"Replay: {r['tokens']} positions from {r['states']}, top-1 accuracy of the draft's first "
                         f"step, run by {r['draft_code']}", "  "))
        rows = []
        for c in r["candidates"][:10]:
            rows.append([c["label"], str(c["boundaries"]), f"{100 * c['accuracy']:.1f}%",
                         "-" if c["ids"] is None else str(c["ids"])])
        out.append(_table(rows, ["wiring", "boundaries", "accuracy", f"ids for {eng}"]))
        search, verdict = r.get("search") or {}, r.get("verdict") or {}
        if search:
            out.append(_wrap(f"Searched {search['wirings_scanned']} wirings (every recorded boundary in every slot: "
                             f"{search['slot_sweeps']} slot sweeps, {search['quick_positions']} then "
                             f"{search['positions']} positions, {search['seconds']} s; computed in "
                             f"{r.get('compute_dtype')}); the draft fed nothing scores "
                             f"{100 * r.get('no_input_accuracy', 0):.1f}%.", "  "))
        if verdict:
            out.append(_wrap(f"Replay verdict: {verdict['word']} ({verdict.get('code')}, below; the live check's "
                             f"word too)", "  "))
    out.append("")
    errors = sum(f.severity == "error" for f in report.findings)
    warns = sum(f.severity == "warning" for f in report.findings)
    out.append("Findings:")
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(report.findings, key=lambda f: order[f.severity]):
        out.append(_wrap(f"{f.severity.upper():7s} {f.code}: {f.text}", "  "))
    out.append("")
    said, *commands = report.conclusion().split("\n")  # commands on lines of their own, unwrapped: pasted as is
    out.append(_wrap(f"Result: {errors} error(s), {warns} warning(s): {said}", ""))
    out.extend(commands)
    return "\n".join(out)


# --------------------------------------------------------------------------------- capture-states
def capture_states_main(argv: Optional[List[str]] = None) -> int:
    """``python -m eagle3_ops capture-states ...``; returns the exit status."""
    return _guard(_capture, list(sys.argv[1:] if argv is None else argv))


def _capture(argv) -> int:
    args = _parse(_capture_parser(), argv)
    from .capture_states import BUILTIN_PROMPTS, capture_states, read_prompts

    if args.max_tokens < 2:
        raise _UsageError("--max-tokens must be >= 2")
    if args.device_map is not None and args.device is not None:
        raise _UsageError("use either --device or --device-map, not both")
    if os.path.isdir(args.out):
        raise _UsageError(f"--out {args.out} is a directory; expected a STATES .safetensors file path")
    from .. import settings
    from .states import StatesError

    problem = settings.output_file_problem(args.out, create_folders=True)  # before minutes of loading a model
    if problem is not None:
        raise _UsageError(f"--out {args.out}: {problem}")
    from .configs import resolve_model_dir

    args.model = str(resolve_model_dir(args.model, "capture-states"))
    prompts = read_prompts(args.prompts) if args.prompts is not None else list(BUILTIN_PROMPTS)
    try:
        summary = capture_states(args.model, prompts, args.out, dtype=args.dtype, max_tokens=args.max_tokens,
                                 device=args.device or "cpu", device_map=args.device_map,
                                 trust_remote_code=args.trust_remote_code)
    except StatesError as e:  # the target changed since the check above (states.save_states_file)
        raise _UsageError(f"--out {args.out}: {e}") from None
    print(f"wrote {summary['out']}: {summary['prompts']} prompts, {summary['tokens']} tokens, "
          f"{summary['num_layers'] + 1} boundaries x hidden {summary['hidden_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
