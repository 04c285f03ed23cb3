"""Regenerate the pinned engine tables from the engines' own code (never edit the JSON by hand).
A maintainer tool (a source checkout's ``tools/``, not shipped in the package):

    python -m tools.engine_tables sglang              # from the installed SGLang
    python -m tools.engine_tables vllm --wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python -m tools.engine_tables sglang --check      # compare with the committed table instead

Each table records what produced it (``generated_from``). SGLang: the installed package, its
ModelRegistry, and for every registered class the result of running its ``set_eagle3_layers_to_capture``
on a stand-in (``eagle3_ops/doctor/sglang_code.py``), and per EAGLE-3 head the tensors its ``load_weights``
loads into its decoder layer (read from its source). vLLM: the wheel's sources read with ``ast``
(``tools/vllm_tables.py``): every architecture of every dict its registry merges into ``_VLLM_MODELS`` (the
Transformers-backend mappings included) and its heads' layer tensors. TensorRT-LLM has no table: the doctor's
rules for it are engine-wide (``eagle3_ops/doctor/engines.py``).
"""
from __future__ import annotations

import argparse
import sys

from eagle3_ops.doctor import sglang_code
from eagle3_ops.doctor.tables import PINNED, TABLES, dumps, table_path


sglang_table = sglang_code.sglang_table  # the package derives it (the doctor keeps one per installed SGLang)


def build(engine: str, wheel=None) -> dict:
    if engine == "sglang":
        t = sglang_table()
        t["generated_from"] = (f"the installed sglang {t['version']} (its ModelRegistry and each class's own "
                               f"set_eagle3_layers_to_capture run on a stand-in; eagle3_ops/doctor/sglang_code.py)")
    else:
        from . import vllm_tables

        t = vllm_tables.table(wheel)
        t["generated_from"] = f"{t.pop('source')} read with ast, not imported (tools/vllm_tables.py)"
    t["generated_by"] = f"python -m tools.engine_tables {engine}"
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.engine_tables", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", choices=TABLES)
    p.add_argument("--wheel", help="vllm: the wheel to read")
    p.add_argument("--check", action="store_true", help="compare with the committed table instead of writing")
    a = p.parse_args(argv)
    if a.engine == "vllm" and not a.wheel:
        p.error("vllm needs --wheel")
    t = build(a.engine, a.wheel)
    if t.get("version") != PINNED[a.engine]:
        print(f"warning: {a.engine} {t.get('version')} is not the pinned {PINNED[a.engine]}", file=sys.stderr)
    out = table_path(a.engine, t.get("version"))
    text = dumps(t)
    if a.check:
        same = out.is_file() and out.read_text() == text
        print(f"{out}: {'up to date' if same else 'DIFFERS from what the engine says'}")
        return 0 if same else 1
    out.write_text(text)
    print(f"wrote {out} ({len(t.get('targets', {}))} target classes, {len(t.get('draft_heads', {}))} draft heads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
