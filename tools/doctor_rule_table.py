"""The doctor's engine rule table in docs/doctor.md, rendered from the pinned tables (never typed by hand).
A maintainer tool (a source checkout's tools/, not the eagle3_ops package); generated text goes into docs/,
never into README.md.

    python -m tools.doctor_rule_table           # print it
    python -m tools.doctor_rule_table --write   # replace the block in docs/doctor.md

``tests/doctor/test_engine_tables.py`` checks docs/doctor.md holds exactly this rendering.
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from eagle3_ops.doctor.tables import PINNED, load

BEGIN = "<!-- doctor-rules:begin (python -m tools.doctor_rule_table --write) -->"
END = "<!-- doctor-rules:end -->"
CODES_BEGIN = "<!-- doctor-codes:begin (python -m tools.doctor_rule_table --write) -->"
CODES_END = "<!-- doctor-codes:end -->"
ROOT = Path(__file__).resolve().parents[1]  # the source checkout this tool lives in
DOC = ROOT / "docs" / "doctor.md"

_RULE = {"id+1": "id + 1", "id+1-if-first-is-1": "id + 1 if the first id is 1, else id",
         "id-if-max-is-L": "id if the largest id is L, else id + 1", "id": "id", None: "not named (see the class)"}
_ENTRY = {"layer-boundary": "layer entry, via the layer boundary (hidden + residual, after the all-reduce)",
          "hidden+residual": "layer entry (hidden + residual)",
          "hidden-only": "layer entry, **hidden_states without the residual**", None: "not located"}
_FINAL = {None: "never", "final-norm": "L, at the final norm", "after-loop": "L, after the last layer"}


def _sglang(t: dict) -> list:
    groups = defaultdict(list)
    refused = 0
    for arch, r in sorted(t["targets"].items()):
        if r.get("supported") is not True:
            refused += r.get("supported") is False
            continue
        c = r.get("capture") or {}
        key = (r.get("id_rule"), " ".join(r.get("default") or ["?"]), c.get("entry"), c.get("final"),
               bool(r.get("uses_layer_flags")), bool(c.get("scaled_embedding")))
        groups[key].append(arch)
    out = [f"SGLang {t['version']} ({len(t['targets'])} registered classes; {sum(map(len, groups.values()))} capture "
           f"for EAGLE-3, {refused} refuse it; generated from {t['generated_from']}):", "",
           "| id -> boundary | default boundaries | captured at | boundary L | notes | classes |",
           "|---|---|---|---|---|---|"]
    for (rule, default, entry, final, flags, scaled), archs in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        notes = []
        if flags:
            notes.append("per-layer flags: an id naming boundary >= L raises IndexError at start-up")
        if scaled:
            notes.append("scaled embeddings")
        out.append(f"| {_RULE.get(rule, rule)} | `{default}` | {_ENTRY.get(entry, entry)} | {_FINAL.get(final, final)} "
                   f"| {'; '.join(notes) or '-'} | {', '.join(archs)} |")
    heads = ", ".join(f"`{a}`" for a in sorted(t["draft_heads"]))
    out += ["", f"SGLang EAGLE-3 draft heads: {heads} ({t['draft_head_rule']}); any other draft architecture is "
                f"loaded as a plain model (`E_DRAFT_CLASS`)."]
    return out


def _vllm(t: dict) -> list:
    rows = t["targets"]
    sup = sorted(a for a, r in rows.items() if r.get("supported"))
    ids = t["ids"]
    return [
        "", f"vLLM {t['version']} (generated from {t['generated_from']}): {len(sup)} of {len(rows)} registered target "
            f"classes implement SupportsEagle3; the others raise at start-up (`E_TARGET_UNSUPPORTED`). Ids are "
            f"boundaries (0 = embeddings), sorted and de-duplicated by EagleModelMixin "
            f"(`{t['layers_setter'].split(' self._aux')[0]}`).",
        "",
        "| runner | function | draft-config keys read, in order |", "|---|---|---|",
        *[f"| {k.upper()} | `{v['function']}` | {', '.join(f'`{x}`' for x in v['reads'])} |" for k, v in ids.items()],
        "",
        f"vLLM EAGLE-3 draft heads: {', '.join(f'`{a}`' for a in sorted(t['draft_heads']))}; a draft's architecture "
        f"`X` is looked up as `{t['draft_rename']['code'].split(' for ')[0]}` (EAGLEConfig); speculators-format "
        "drafts by layer type: "
        + ", ".join(f"{k} -> `{v}`" for k, v in sorted(t["speculators_eagle3_arch_map"].items())) + ".",
        "",
        f"Targets served: {', '.join(sup)}.",
    ]


def render() -> str:
    s, v = load("sglang"), load("vllm")
    lines = _sglang(s) + _vllm(v)
    lines += ["", f"TensorRT-LLM {PINNED['trtllm']}: no per-class table (its wheel cannot be downloaded here and no "
                  f"stored commit is known to be v{PINNED['trtllm']}); the engine-wide rules in `doctor/engines.py` "
                  f"were read from its GitHub sources, and every TensorRT-LLM report says the class is unverified "
                  f"(`W_TARGET_SUPPORT_UNVERIFIED`)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tools.doctor_rule_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help=f"write the table into {DOC.name} (default: print it)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    text = render()
    if not args.write:
        sys.stdout.write(text)
        return 0
    from eagle3_ops.doctor import codes

    doc = DOC.read_text()
    for begin, end, block in ((BEGIN, END, text), (CODES_BEGIN, CODES_END, codes.markdown())):
        if begin not in doc or end not in doc:
            print(f"{DOC} has no {begin} ... {end} block", file=sys.stderr)
            return 1
        head, rest = doc.split(begin, 1)
        _, tail = rest.split(end, 1)
        doc = head + begin + "\n" + block + end + tail
    DOC.write_text(doc)
    print(f"wrote the rule table and the code table into {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
