"""Regenerate the pinned engine tables from the engines' own code (never edit the JSON by hand).

    python -m eagle3_ops.doctor.tables.generate sglang              # from the installed SGLang
    python -m eagle3_ops.doctor.tables.generate vllm --wheel vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    python -m eagle3_ops.doctor.tables.generate trtllm --src TensorRT-LLM/ --commit SHA

Each table records what produced it (``generated_from``). SGLang: the installed package, its
ModelRegistry, and for every registered class the result of running its
``set_eagle3_layers_to_capture`` on a stand-in (``doctor/sglang_code.py``), and per EAGLE-3 head the tensors
its ``load_weights`` loads into its decoder layer (read from its source). vLLM: the wheel's sources read with
``ast`` (``doctor/vllm_code.py``): every architecture of every dict its registry merges into ``_VLLM_MODELS``
(the Transformers-backend mappings included) and its heads' layer tensors. TensorRT-LLM: a source checkout
(``doctor/trtllm_code.py``).
"""
from __future__ import annotations

import argparse
import sys

from . import PINNED, dumps, table_path


def build(engine: str, wheel=None, src=None, commit=None) -> dict:
    if engine == "sglang":
        from .. import sglang_code

        t = sglang_code.table()
        t["generated_from"] = (f"the installed sglang {t['version']} (its ModelRegistry and each class's own "
                               f"set_eagle3_layers_to_capture run on a stand-in; eagle3_ops/doctor/sglang_code.py)")
    elif engine == "vllm":
        from .. import vllm_code

        t = vllm_code.table(wheel)
        t["generated_from"] = f"{t.pop('source')} read with ast, not imported (eagle3_ops/doctor/vllm_code.py)"
    else:
        from .. import trtllm_code

        t = trtllm_code.table(src, commit)
    t["generated_by"] = f"python -m eagle3_ops.doctor.tables.generate {engine}"
    return t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3_ops.doctor.tables.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", choices=sorted(PINNED))
    p.add_argument("--wheel", help="vllm: the wheel to read")
    p.add_argument("--src", help="trtllm: a TensorRT-LLM source checkout")
    p.add_argument("--commit", help="trtllm: the commit of --src (recorded in the table)")
    p.add_argument("--check", action="store_true", help="compare with the committed table instead of writing")
    a = p.parse_args(argv)
    if a.engine == "vllm" and not a.wheel:
        p.error("vllm needs --wheel")
    if a.engine == "trtllm" and not (a.src and a.commit):
        p.error("trtllm needs --src and --commit")
    t = build(a.engine, a.wheel, a.src, a.commit)
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
