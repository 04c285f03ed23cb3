"""Reading an engine's capture code from its source text (Python ``ast``), shared by the live SGLang
path, the table generator and the vLLM / TensorRT-LLM source readers.

Nothing here knows a model family: it finds the places where a model's layer loop tests
``<x> in self.layers_to_capture`` (or a per-layer ``_is_layer_to_capture`` flag), and classifies each
by where it sits in the code — inside the loop over layers (the entry of layer ``i``), inside a call to
the final norm, or after the loop — and by what is captured there (passed into SGLang's layer
boundary, ``hidden_states + residual``, or ``hidden_states`` alone while the loop carries a separate
residual).
"""
from __future__ import annotations

import ast
import re
import textwrap
from typing import Dict, Iterable, List, Optional

# names a final-boundary test compares with (``self.end_layer in self.layers_to_capture``)
_FINAL_NAMES = re.compile(r"^(self\.end_layer|num_layers|total_num_layers|len\(self\.layers\)|"
                          r"self\.config\.num_hidden_layers|self\.num_layers)$")


# SGLang's layer-boundary capture arguments (the layer captures hidden + residual after its all-reduce)
_BOUNDARY_ARGS = ("capture_output", "capture", "captured_last_layer_outputs")


def parse_function(src: str) -> Optional[ast.AST]:
    """The ``ast`` module of source text ``src`` (dedented first, so a method's source parses), or None when it is not
    valid Python."""
    try:
        return ast.parse(textwrap.dedent(src))
    except SyntaxError:
        return None


def _parents(tree: ast.AST) -> Dict[ast.AST, ast.AST]:
    out = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            out[child] = node
    return out


def _is_capture_test(node: ast.AST, attr: str) -> Optional[str]:
    """``X in self.<attr>`` -> the source of X; ``getattr(layer, "_is_layer_to_capture", ...)`` or
    ``layer._is_layer_to_capture`` -> "flag"."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.In):
        right = node.comparators[0]
        if isinstance(right, ast.Attribute) and right.attr == attr and isinstance(right.value, ast.Name) \
                and right.value.id == "self":
            return ast.unparse(node.left)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and \
            len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
            node.args[1].value == "_is_layer_to_capture":
        return "flag"
    if isinstance(node, ast.Attribute) and node.attr == "_is_layer_to_capture" and isinstance(node.ctx, ast.Load):
        return "flag"
    return None


def capture_sites(sources: Iterable[str], attr: str = "layers_to_capture") -> List[dict]:
    """Every capture test in the given function sources, classified:

    ``{"where": "entry" | "final-norm" | "after-loop", "test": "<x> in self.layers_to_capture" | "flag",
    "value": "layer-boundary" | "hidden+residual" | "hidden-only" | "unknown", "code": <line>}``."""
    sites = []
    for src in sources:
        tree = parse_function(src)
        if tree is None:
            continue
        parents = _parents(tree)
        # does the function's layer loop carry a separate residual (``hidden_states, residual = layer(...)``)?
        carries_residual = any(isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple) and
                               "residual" in [getattr(e, "id", None) for e in n.targets[0].elts]
                               for n in ast.walk(tree))
        for node in ast.walk(tree):
            left = _is_capture_test(node, attr)
            if left is None or (left == "flag" and isinstance(node, ast.Attribute) and
                                isinstance(parents.get(node), ast.Call)):
                continue
            chain, p = [], parents.get(node)
            while p is not None:
                chain.append(p)
                p = parents.get(p)
            in_loop = any(isinstance(a, (ast.For, ast.While)) for a in chain)
            in_norm = any(isinstance(a, ast.Call) and ast.unparse(a.func).endswith(("final_norm", "norm"))
                          for a in chain)
            if left != "flag" and _FINAL_NAMES.match(left):
                where = "final-norm" if in_norm else "after-loop"
            elif in_loop:
                where = "entry"
            else:
                continue  # a test outside the layer loop on something else (not a capture point)
            value = "unknown"
            if any((isinstance(a, ast.keyword) and a.arg in _BOUNDARY_ARGS) or
                   (isinstance(a, ast.Assign) and any(getattr(t, "id", None) in _BOUNDARY_ARGS for t in a.targets))
                   for a in chain):
                value = "layer-boundary"
            else:
                stmt = next((a for a in chain if isinstance(a, ast.If)), None)
                if stmt is not None:
                    body = " ".join(ast.unparse(s) for s in stmt.body)
                    m = re.search(r"aux_hidden_states\.append\((.*?)\)\s*$", body)
                    if m:
                        arg = m.group(1).replace(" ", "")
                        if arg in ("hidden_states+residual", "residual+hidden_states"):
                            value = "hidden+residual"
                        elif arg == "hidden_states":
                            value = "hidden-only" if carries_residual else "hidden+residual"
                        elif "snapshot" in arg:
                            value = "layer-boundary"
            code = ast.unparse(next((a for a in chain if isinstance(a, (ast.If, ast.keyword, ast.IfExp))), node))
            sites.append({"where": where, "test": "flag" if left == "flag" else f"{left} in self.{attr}",
                          "value": value, "code": code.splitlines()[0][:160]})
    out, seen = [], set()
    for s in sites:
        key = (s["where"], s["test"], s["value"])
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def scaled_embedding(source: str) -> Optional[str]:
    """The line that scales the token embeddings (Gemma's ``embed_scale=hidden_size**0.5``), if any."""
    for line in source.splitlines():
        s = line.strip()
        if re.search(r"embed_scale\s*=.*hidden_size\s*\*\*\s*0\.5|normalizer\s*=.*hidden_size\s*\*\*\s*0\.5", s):
            return s
    return None
