"""``python -m eagle3_ops doctor`` and ``python -m eagle3_ops capture-states``.

Exit status: 0 = no error finding, 1 = at least one error finding, 2 = bad usage or unreadable
input (one clear line on stderr, no traceback; ``EAGLE3_OPS_DEBUG=1`` re-raises unexpected errors).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from typing import List, Optional

from .configs import CONVENTIONS, DoctorInputError

DOCTOR_DESCRIPTION = """\
Check which hidden states an inference engine feeds an EAGLE-3 draft, and whether they are the
ones the draft was trained on. Reads both config.json files and the draft's safetensors headers
(never all weights). With --replay, also runs the draft's first step on recorded target states
for the configured and candidate wirings and compares their next-token accuracy.

"Boundary i" = Hugging Face output_hidden_states[i] = the residual stream entering decoder layer i
(layers count from 0) = the output of layer i-1; boundary 0 = token embeddings.
"""


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # never exit from inside the library; report and return 2
        raise _UsageError(f"{self.prog}: {message}")


def _ids(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return out


def _doctor_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m eagle3_ops doctor", description=DOCTOR_DESCRIPTION,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", required=True, metavar="DRAFT_DIR", help="EAGLE-3 draft checkpoint directory")
    p.add_argument("--target", required=True, metavar="TARGET_DIR", help="target model directory (config.json)")
    p.add_argument("--engine", choices=("sglang", "vllm", "trtllm"), default="sglang",
                   help="serving engine whose id rules apply (default: sglang)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel size of the target")
    p.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline-parallel size of the target")
    p.add_argument("--pp-partition", type=_ids, default=None, metavar="N,N,..",
                   help="layers per pipeline stage (SGLANG_PP_LAYER_PARTITION), default: even split")
    p.add_argument("--json", action="store_true", help="print a JSON report instead of tables")
    p.add_argument("--replay", metavar="STATES", help="safetensors file from capture-states: score wirings")
    p.add_argument("--replay-margin", type=float, default=0.02, metavar="F",
                   help="accuracy gain (absolute) another wiring needs to be reported as an error (default 0.02)")
    p.add_argument("--replay-sweep", action="store_true",
                   help="also try every boundary in each slot (K x (L+1) more draft runs; finds a slot whose "
                        "trained layer is far from the configured one)")
    p.add_argument("--replay-max-tokens", type=int, default=4096, metavar="N", help="positions scored (default 4096)")
    p.add_argument("--device", default="cpu", help="device for --replay (default cpu)")
    p.add_argument("--trained-convention", choices=("auto",) + CONVENTIONS, default="auto",
                   help="how the draft's ids were read during training: layer-output = 'output of layer k' "
                        "(SpecForge/SGLang), layer-input = 'entering layer k' (vLLM/speculators); "
                        "auto: from the config dialect")
    p.add_argument("--trained-ids", type=_ids, default=None, metavar="N,N,..",
                   help="ids the draft was actually trained with, if its config.json was edited since")
    p.add_argument("--capture-point", choices=("auto", "after-allreduce", "before-allreduce"), default="auto",
                   help="where captures are taken relative to the TP all-reduce (for custom capture hooks); "
                        "auto: the engine's stock path")
    return p


def _capture_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m eagle3_ops capture-states",
                description="Record a target's hidden states at every layer boundary with Hugging Face "
                            "transformers, for `doctor --replay`.")
    p.add_argument("--model", required=True, metavar="TARGET_DIR")
    p.add_argument("--prompts", required=True, metavar="FILE",
                   help="JSON list of strings or token-id lists, or text with one prompt per line")
    p.add_argument("--out", required=True, metavar="STATES.safetensors")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--max-tokens", type=int, default=512, metavar="N", help="tokens kept per prompt")
    p.add_argument("--device", default="cpu")
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
    try:
        return fn(argv)
    except _Exit as e:
        return e.code
    except (_UsageError, DoctorInputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # unreadable input of a kind not foreseen: still no traceback
        if os.environ.get("EAGLE3_OPS_DEBUG") == "1":
            raise
        print(f"error: {type(e).__name__}: {e} (set EAGLE3_OPS_DEBUG=1 for a traceback)", file=sys.stderr)
        return 2


# ----------------------------------------------------------------------------------------- doctor
def main(argv: Optional[List[str]] = None) -> int:
    """``python -m eagle3_ops doctor ...``; returns the exit status."""
    return _guard(_doctor, list(sys.argv[1:] if argv is None else argv))


def build_report(args):
    from .checks import Options, run_checks
    from .configs import parse_draft, parse_target, read_weight_headers

    if args.tp < 1:
        raise _UsageError(f"--tp must be >= 1, got {args.tp}")
    if args.pp < 1:
        raise _UsageError(f"--pp must be >= 1, got {args.pp}")
    target = parse_target(args.target)
    draft = parse_draft(args.draft)
    if args.pp > target.num_layers:
        raise _UsageError(f"--pp {args.pp} exceeds the target's {target.num_layers} layers")
    if args.pp_partition is not None:
        if len(args.pp_partition) != args.pp or sum(args.pp_partition) != target.num_layers \
                or min(args.pp_partition) < 1:
            raise _UsageError(f"--pp-partition {args.pp_partition} must list {args.pp} positive layer counts "
                              f"summing to {target.num_layers}")
    weights = read_weight_headers(draft.path)
    opts = Options(engine=args.engine, tp=args.tp, pp=args.pp, pp_partition=args.pp_partition,
                   trained_convention=args.trained_convention, trained_ids=args.trained_ids,
                   capture_point=args.capture_point)
    report = run_checks(target, draft, weights, opts)
    if args.replay:
        from .replay import run_replay

        if args.replay_max_tokens < 1:
            raise _UsageError("--replay-max-tokens must be >= 1")
        run_replay(report, weights, args.replay, margin=args.replay_margin, max_tokens=args.replay_max_tokens,
                   device=args.device, sweep=args.replay_sweep)
    return report


def _doctor(argv) -> int:
    args = _parse(_doctor_parser(), argv)
    report = build_report(args)
    status = 0 if report.ok else 1
    try:
        print(json.dumps(report.to_json(), indent=2) if args.json else format_report(report))
        sys.stdout.flush()
    except BrokenPipeError:  # `doctor ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return status


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
    from .engines import ENGINE_NAMES, rule_text

    t, d, o = report.target, report.draft, report.options
    eng = ENGINE_NAMES[o.engine]
    L = t.num_layers
    out = ["EAGLE-3 wiring doctor", _wrap(f"target : {t.path}  ({t.describe()})", "  "),
           _wrap(f"draft  : {d.path}  ({d.describe()})", "  ")]
    if report.wiring is not None:
        w = report.wiring
        rule = rule_text(o.engine, w.family) + (f" ({w.family_evidence})" if o.engine == "sglang" else "")
        ids = f"ids {w.ids} from {w.ids_source}" if w.ids is not None else \
            f"no ids: {w.ids_source} = boundaries {w.config_order}"
        out.append(_wrap(f"engine : {eng}, tp={o.tp}, pp={o.pp}; {eng} rule: boundary = {rule}; {ids}", "  "))
    if report.training is not None:
        out.append(_wrap(f"trained: {report.training.source}", "  "))
    out.append("")
    out.append(_wrap(f"How to read the table: layers count from 0 to {L - 1}. Boundary i is the residual stream "
                     f"entering layer i, which is the output of layer i-1 (Hugging Face output_hidden_states[i]); "
                     f"boundary 0 is the token embeddings, boundary {L} the output of the last layer.", "  "))
    if report.slots:
        rows = []
        for s in report.slots:
            cid = "default" if s["config_id"] is None and s["capture_index"] is not None else \
                ("-" if s["config_id"] is None else str(s["config_id"]))
            cap = "-" if s["capture_index"] is None else str(s["capture_index"])
            trained_on = "(same)" if s["match"] else s["draft_trained_on"]
            rows.append([s["slot"], cid, cap, s["engine_reads"], "-" if s["trained_index"] is None else
                         s["trained_index"], trained_on, "yes" if s["match"] else "NO"])
        out.append("")
        out.append(_table(rows, ["slot", "id", f"{eng} boundary", f"what {eng} feeds the draft",
                                 "trained", "what the draft was trained on", "ok"]))
    if report.replay is not None:
        r = report.replay
        out.append("")
        out.append(f"  Replay: {r['tokens']} positions from {r['states']}, top-1 accuracy of the draft's first step")
        rows = []
        for c in r["candidates"][:10]:
            rows.append([c["label"], str(c["boundaries"]), f"{100 * c['accuracy']:.1f}%",
                         "-" if c["ids"] is None else str(c["ids"])])
        out.append(_table(rows, ["wiring", "boundaries", "accuracy", f"ids for {eng}"]))
    out.append("")
    errors = sum(f.severity == "error" for f in report.findings)
    warns = sum(f.severity == "warning" for f in report.findings)
    out.append("Findings:")
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(report.findings, key=lambda f: order[f.severity]):
        out.append(_wrap(f"{f.severity.upper():7s} {f.code}: {f.message}", "  "))
    out.append("")
    out.append(f"Result: {errors} error(s), {warns} warning(s): "
               + ("the wiring looks right." if errors == 0 else "fix the errors above (exit status 1)."))
    return "\n".join(out)


# --------------------------------------------------------------------------------- capture-states
def capture_states_main(argv: Optional[List[str]] = None) -> int:
    """``python -m eagle3_ops capture-states ...``; returns the exit status."""
    return _guard(_capture, list(sys.argv[1:] if argv is None else argv))


def _capture(argv) -> int:
    args = _parse(_capture_parser(), argv)
    from .capture_states import capture_states, read_prompts

    if args.max_tokens < 2:
        raise _UsageError("--max-tokens must be >= 2")
    prompts = read_prompts(args.prompts)
    summary = capture_states(args.model, prompts, args.out, dtype=args.dtype, max_tokens=args.max_tokens,
                             device=args.device)
    print(f"wrote {summary['out']}: {summary['prompts']} prompts, {summary['tokens']} tokens, "
          f"{summary['num_layers'] + 1} boundaries x hidden {summary['hidden_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
