"""vLLM's EAGLE-3 code, read from its source (a wheel or an installed tree) without importing vLLM.

vLLM is not a dependency of this project; the generator reads the pinned wheel
(``python -m eagle3_ops.doctor.tables.generate vllm --wheel vllm-0.33.0-*.whl``). What is read:

- the model registry (``model_executor/models/registry.py``: architecture -> (module, class));
- each class's bases, resolved through its module's imports: a target is served for EAGLE-3 when
  ``SupportsEagle3`` (``interfaces.py``) is among them (``eagle3_utils.set_eagle3_aux_hidden_state_layers``
  raises "Model does not support EAGLE3 interface" otherwise);
- the default ids (``get_eagle3_default_aux_hidden_state_layers``, the interface's or an override);
- the decoder model the class builds (``self.model = X(...)``) and, in its source, where captures are taken
  (``_maybe_add_hidden_state(aux, <index>, ...)`` / ``<index> in self.aux_hidden_state_layers``: the entry of
  layer ``idx``, after layer ``idx`` (``idx + 1``), the stage start, the end) and whether it relays captures
  across pipeline stages (``supports_aux_hidden_states_over_pp``);
- where each model runner reads the draft's ids (the config keys its function reads, in order);
- the EAGLE-3 draft heads (speculative registry entries served from ``*eagle3*`` modules) and the
  architecture rename ``EAGLEConfig`` applies to a draft (``Eagle3{arch}``).
"""
from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

MODELS = "vllm/model_executor/models/"
TARGET_REGISTRIES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")


class SourceTree:
    """Python sources of a vLLM wheel (zip) or an unpacked tree, by path inside the package root."""

    def __init__(self, path):
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None
        self._cache: Dict[str, Optional[str]] = {}

    def read(self, rel: str) -> Optional[str]:
        if rel not in self._cache:
            try:
                if self._zip is not None:
                    self._cache[rel] = self._zip.read(rel).decode()
                else:
                    self._cache[rel] = (self.path / rel).read_text()
            except (KeyError, OSError):
                self._cache[rel] = None
        return self._cache[rel]

    def version(self) -> Optional[str]:
        src = self.read("vllm/_version.py") or ""
        m = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)""", src) or \
            re.search(r"""__version__\s*=\s*['"]([^'"]+)""", src)
        return m.group(1) if m else None


def _literal_dicts(src: str, names) -> Dict[str, Dict[str, Tuple[str, str]]]:
    tree = ast.parse(src)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id in names and isinstance(node.value, ast.Dict):
                d = {}
                for k, v in zip(node.value.keys, node.value.values):
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2 and \
                            all(isinstance(e, ast.Constant) for e in v.elts):
                        d[k.value] = (v.elts[0].value, v.elts[1].value)
                out[target.id] = d
    return out


def _module_path(mod: str) -> str:
    return MODELS + mod + ".py" if "." not in mod else mod.replace(".", "/") + ".py"


class _Module:
    def __init__(self, tree: SourceTree, rel: str):
        self.rel = rel
        self.src = tree.read(rel)
        self.ast = ast.parse(self.src) if self.src else None
        self.classes: Dict[str, ast.ClassDef] = {}
        self.imports: Dict[str, Tuple[str, str]] = {}  # local name -> (module path, name)
        if self.ast is None:
            return
        pkg = rel.rsplit("/", 1)[0]
        for node in ast.walk(self.ast):
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, node)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split("/")
                    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                    mod = "/".join(base + (node.module.split(".") if node.module else []))
                else:
                    mod = (node.module or "").replace(".", "/")
                for a in node.names:
                    self.imports[a.asname or a.name] = (mod + ".py", a.name)


class Index:
    """Classes of vLLM's model modules with their bases resolved across modules."""

    def __init__(self, tree: SourceTree):
        self.tree = tree
        self._mods: Dict[str, _Module] = {}

    def module(self, rel: str) -> _Module:
        if rel not in self._mods:
            self._mods[rel] = _Module(self.tree, rel)
        return self._mods[rel]

    def find(self, rel: str, name: str, depth: int = 0) -> Optional[Tuple[_Module, ast.ClassDef]]:
        m = self.module(rel)
        if name in m.classes:
            return m, m.classes[name]
        if name in m.imports and depth < 6:
            mod, real = m.imports[name]
            if self.tree.read(mod) is None:  # a package: its __init__.py
                mod = mod[:-3] + "/__init__.py"
            return self.find(mod, real, depth + 1)
        return None

    def mro(self, rel: str, name: str) -> List[Tuple[_Module, ast.ClassDef]]:
        out, seen = [], set()

        def visit(r, n, depth):
            hit = self.find(r, n)
            if hit is None or depth > 20:
                return
            m, c = hit
            key = (m.rel, c.name)
            if key in seen:
                return
            seen.add(key)
            out.append(hit)
            for b in c.bases:
                bn = b.value.id if isinstance(b, ast.Subscript) and isinstance(b.value, ast.Name) else \
                    (b.id if isinstance(b, ast.Name) else (b.attr if isinstance(b, ast.Attribute) else None))
                if bn:
                    visit(m.rel, bn, depth + 1)
        visit(rel, name, 0)
        return out


def _method(cls: ast.ClassDef, name: str) -> Optional[ast.FunctionDef]:
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _class_var(cls: ast.ClassDef, name: str):
    for n in cls.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            t = n.targets[0] if isinstance(n, ast.Assign) else n.target
            if isinstance(t, ast.Name) and t.id == name and n.value is not None:
                try:
                    return ast.literal_eval(n.value)
                except ValueError:
                    return ast.unparse(n.value)
    return None


def _first_return(fn: ast.FunctionDef) -> Optional[str]:
    r = next((n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None), None)
    return ast.unparse(r.value) if r is not None else None


def capture_sites(fn_sources: List[str]) -> List[dict]:
    """Where a vLLM decoder model captures: each ``_maybe_add_hidden_state(aux, <index>, h, r)`` call or
    ``<index> in self.aux_hidden_state_layers`` test, with the index expression and whether it sits in the
    layer loop. ``boundary``: "start" (stage start, before the loop), "entry" (``idx``: before layer idx),
    "after" (``idx + 1``), "end" (``self.end_layer`` after the loop)."""
    out = []
    for src in fn_sources:
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        fn0 = tree.body[0] if tree.body else None
        if isinstance(fn0, ast.FunctionDef) and fn0.name == "_maybe_add_hidden_state":
            continue  # the mixin's helper itself; its callers say where
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        loops = [n for n in ast.walk(tree) if isinstance(n, ast.For)]
        loop_vars = {ast.unparse(n.target.elts[0] if isinstance(n.target, ast.Tuple) else n.target) for n in loops}
        for node in ast.walk(tree):
            idx = None
            if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("_maybe_add_hidden_state") and \
                    len(node.args) >= 2:
                idx, value = ast.unparse(node.args[1]), "hidden+residual"
            elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In) and \
                    ast.unparse(node.comparators[0]) == "self.aux_hidden_state_layers":
                idx = ast.unparse(node.left)
                stmt = parents.get(node)
                body = " ".join(ast.unparse(s) for s in getattr(stmt, "body", []))
                value = "hidden+residual" if "hidden_states + residual" in body else "unknown"
                if value == "hidden+residual" and "residual is not None" not in body and \
                        "residual is None" not in body:
                    value = "hidden+residual-unguarded"  # raises while residual is still None
            if idx is None:
                continue
            p, in_loop = parents.get(node), False
            while p is not None:
                in_loop = in_loop or isinstance(p, ast.For)
                p = parents.get(p)
            compact = idx.replace(" ", "")
            if in_loop and compact in loop_vars:
                kind = "entry"
            elif in_loop and any(compact == f"{v}+1" for v in loop_vars):
                kind = "after"
            elif not in_loop and compact in ("self.start_layer", "0"):
                kind = "start"
            elif not in_loop and compact in ("self.end_layer", "len(self.layers)"):
                kind = "end"
            else:
                kind = f"other:{compact}"
            out.append({"boundary": kind, "index": idx, "value": value})
    seen, uniq = set(), []
    for s in out:
        k = (s["boundary"], s["value"])
        if k not in seen:
            seen.add(k)
            uniq.append(s)
    return uniq


def _sources(m: _Module, c: ast.ClassDef) -> List[str]:
    return [ast.get_source_segment(m.src, n) or "" for n in c.body if isinstance(n, ast.FunctionDef)]


def _inner_model(index: "Index", mro, registry: Dict[str, Tuple[str, str]], depth: int = 0):
    """The decoder model a ForCausalLM builds: ``self.model = X(...)``, ``self.model_cls(...)`` or
    ``self._init_model(...)`` returning it; for wrappers, the language model's (``init_vllm_registered_model(...,
    architectures=["X"])`` through the registry). Returns ((module, class) or None, how)."""
    def resolve(mm, fn):
        if fn.startswith("self."):
            attr = fn[5:]
            for m2, k in mro:
                meth = _method(k, attr)
                if meth is not None:
                    ret = next((n for n in ast.walk(meth) if isinstance(n, ast.Return) and
                                isinstance(n.value, ast.Call)), None)
                    return resolve(m2, ast.unparse(ret.value.func)) if ret is not None else None
                var = _class_var(k, attr)
                if isinstance(var, str) and re.match(r"^\w+$", var):
                    return index.find(m2.rel, var)
            return None
        return index.find(mm.rel, fn) if re.match(r"^\w+$", fn) else None

    for mm, cc in mro:
        init = _method(cc, "__init__")
        if init is None:
            continue
        for node in ast.walk(init):
            if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute) and
                    ast.unparse(node.targets[0]) in ("self.model", "self.language_model") and
                    isinstance(node.value, ast.Call)):
                continue
            fn = ast.unparse(node.value.func)
            model_class = next((kw.value for kw in node.value.keywords if kw.arg == "model_class"), None)
            if fn.endswith("initialize_model") and isinstance(model_class, ast.Name):
                hit = index.find(mm.rel, model_class.id)
                if hit is None or depth > 2:
                    return None, f"initialize_model(model_class={model_class.id}) not located"
                sub = index.mro(hit[0].rel, hit[1].name)
                return (_inner_model(index, sub, registry, depth + 1)[0] or hit,
                        f"initialize_model(model_class={model_class.id})")
            if fn.endswith("init_vllm_registered_model"):
                archs = next((kw.value for kw in node.value.keywords if kw.arg == "architectures"), None)
                try:
                    names = ast.literal_eval(archs) if archs is not None else None
                except ValueError:
                    names = None
                if not names or names[0] not in registry or depth > 2:
                    return None, "the text config's architectures (init_vllm_registered_model, chosen at start-up)"
                mod, name = registry[names[0]]
                sub = index.mro(_module_path(mod), name)
                return _inner_model(index, sub, registry, depth + 1)[0], f"init_vllm_registered_model({names[0]})"
            hit = resolve(mm, fn)
            if hit is None:
                continue
            if ast.unparse(node.targets[0]) == "self.language_model" and depth < 3:
                sub = index.mro(hit[0].rel, hit[1].name)
                inner = _inner_model(index, sub, registry, depth + 1)[0]
                return inner or hit, f"language_model {hit[1].name}"
            return hit, f"self.model = {hit[1].name}"
    return None, "not located"


def _language_model(index: "Index", mro, registry):
    """The class a wrapper builds as ``self.language_model`` (``initialize_model(model_class=X)``,
    ``init_vllm_registered_model(architectures=["A"])``, or ``X(...)``)."""
    for mm, cc in mro:
        init = _method(cc, "__init__")
        for node in ast.walk(init) if init is not None else ():
            if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "self.language_model" and \
                    isinstance(node.value, ast.Call):
                kw = {k.arg: k.value for k in node.value.keywords}
                if isinstance(kw.get("model_class"), ast.Name):
                    return index.find(mm.rel, kw["model_class"].id)
                if "architectures" in kw:
                    try:
                        names = ast.literal_eval(kw["architectures"])
                    except ValueError:
                        names = None
                    if names and names[0] in registry:
                        mod, name = registry[names[0]]
                        return index.find(_module_path(mod), name)
                fn = ast.unparse(node.value.func)
                if re.match(r"^\w+$", fn):
                    return index.find(mm.rel, fn)
    return None


def describe_target(index: Index, arch: str, mod: str, name: str, registry: Dict[str, Tuple[str, str]]) -> dict:
    rel = _module_path(mod)
    mro = index.mro(rel, name)
    if not mro:
        return {"supported": None, "class": f"{mod}.{name}", "reason": "class source not found"}
    bases = [c.name for _, c in mro]
    row = {"class": f"{mod}.{name}", "supported": "SupportsEagle3" in bases}
    if not row["supported"]:
        row["reason"] = (f"{name} does not implement SupportsEagle3: eagle3_utils.set_eagle3_aux_hidden_state_layers "
                         f"raises 'Model does not support EAGLE3 interface'")
        return row
    override = next(((m, c) for m, c in mro if c.name != "SupportsEagle3" and
                     _method(c, "get_eagle3_default_aux_hidden_state_layers") is not None), None)
    iface = next(((m, c) for m, c in mro if c.name == "SupportsEagle3"), None)
    src_default = override or iface
    row["default"] = _first_return(_method(src_default[1], "get_eagle3_default_aux_hidden_state_layers")) \
        if src_default else None
    row["default_from"] = src_default[1].name if src_default else None
    if (row["default"] or "").startswith("self.language_model."):  # a wrapper asking its language model
        lm = _language_model(index, mro, registry)
        row["default_delegated_to"] = lm[1].name if lm else None
        row["default"] = None
        if lm is not None:
            lmro = index.mro(lm[0].rel, lm[1].name)
            hit = next(((m, c) for m, c in lmro if _method(c, "get_eagle3_default_aux_hidden_state_layers")), None)
            row["default"] = _first_return(_method(hit[1], "get_eagle3_default_aux_hidden_state_layers")) \
                if hit else None
    setter = next((c.name for m, c in mro if _method(c, "set_aux_hidden_state_layers") is not None), None)
    row["set_aux_hidden_state_layers"] = setter
    inner, how = _inner_model(index, mro, registry)
    row["decoder_how"] = how
    if inner is not None:
        imro = index.mro(inner[0].rel, inner[1].name)
        srcs = [s for mm, cc in imro for s in _sources(mm, cc)]
        row["decoder"] = f"{inner[0].rel[len(MODELS):-3] if inner[0].rel.startswith(MODELS) else inner[0].rel}." \
                         f"{inner[1].name}"
        row["capture"] = capture_sites(srcs)
        row["pp_relay"] = any(_class_var(cc, "supports_aux_hidden_states_over_pp") is True for _, cc in imro)
        own_setter = next((cc.name for _, cc in imro if _method(cc, "_set_aux_hidden_state_layers")), None)
        row["layers_setter"] = own_setter
    else:
        row["decoder"], row["capture"], row["pp_relay"] = None, [], False
    return row


def _keys_read(fn: ast.FunctionDef) -> List[str]:
    """Config keys a function reads from the draft config, in order: ``getattr(hf_config, "K")`` -> K,
    ``X.get("K")`` where X came from ``getattr(hf_config, "P")`` -> P.K."""
    origin: Dict[str, str] = {}
    keys = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call):
            call = node.value
            if ast.unparse(call.func) == "getattr" and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant):
                origin[node.targets[0].id] = call.args[1].value
    for node in sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
        f = ast.unparse(node.func)
        if f == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                ast.unparse(node.args[0]) == "hf_config":
            keys.append(node.args[1].value)
        elif f.endswith(".get") and node.args and isinstance(node.args[0], ast.Constant):
            base = f[:-4]
            if base in origin:
                keys.append(f"{origin[base]}.{node.args[0].value}")
    return keys


def ids_readers(tree: SourceTree) -> dict:
    out = {}
    for runner, rel, name in (("v2", "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py",
                               "get_eagle3_aux_layers_from_config"),
                              ("v1", "vllm/v1/worker/gpu_model_runner.py", "_get_eagle3_aux_layers_from_config")):
        src = tree.read(rel)
        fn = next((n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == name),
                  None) if src else None
        out[runner] = {"function": f"{rel[len('vllm/'):]}:{name}", "reads": _keys_read(fn) if fn else None}
    return out


# the one rename form the doctor applies; any other code is recorded as "unknown"
PREFIX_EAGLE3 = ('arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}" '
                 'for arch in self.model.architectures')


def draft_rename(tree: SourceTree) -> dict:
    """How EAGLEConfig renames a draft's architectures for method eagle3 (transformers_utils/configs/eagle.py)."""
    src = tree.read("vllm/transformers_utils/configs/eagle.py") or ""
    m = re.search(r'elif method == "eagle3":.*?kwargs\["architectures"\] = \[(.*?)\]', src, re.S)
    code = " ".join(m.group(1).split()) if m else None
    return {"code": code, "rule": "prefix-Eagle3" if code == PREFIX_EAGLE3 else "unknown"}


def speculators_eagle3(tree: SourceTree) -> Optional[dict]:
    """The class a speculators-format EAGLE-3 draft becomes, by its transformer_layer_config.model_type
    (``transformers_utils/configs/speculators/algos.py: update_eagle3``)."""
    src = tree.read("vllm/transformers_utils/configs/speculators/algos.py")
    if not src:
        return None
    fn = next((n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "update_eagle3"),
              None)
    for node in ast.walk(fn) if fn is not None else ():
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "eagle3_arch_map":
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def table(path) -> dict:
    tree = SourceTree(path)
    index = Index(tree)
    regs = _literal_dicts(tree.read(MODELS + "registry.py"), TARGET_REGISTRIES + ("_SPECULATIVE_DECODING_MODELS",))
    targets = {}
    all_targets = {a: v for reg in TARGET_REGISTRIES for a, v in regs.get(reg, {}).items()}
    for reg in TARGET_REGISTRIES:
        for arch, (mod, name) in sorted(regs.get(reg, {}).items()):
            targets[arch] = describe_target(index, arch, mod, name, all_targets)
    heads = {}
    for arch, (mod, name) in sorted(regs.get("_SPECULATIVE_DECODING_MODELS", {}).items()):
        if "eagle3" in mod:
            src = tree.read(_module_path(mod)) or ""
            heads[arch] = {"class": f"{mod}.{name}", "reads_tie_word_embeddings": "tie_word_embeddings" in src,
                           "lm_head_rows": "draft_vocab_size"
                           if re.search(r"ParallelLMHead\(\s*self\.config\.draft_vocab_size", src) else None}
    iface = tree.read(MODELS + "interfaces.py") or ""
    m = re.search(r"def _set_aux_hidden_state_layers\(.*?\n(.*?)\n\n", iface, re.S)
    return {"engine": "vllm", "version": tree.version(), "source": Path(path).name, "targets": targets,
            "draft_heads": heads, "draft_rename": draft_rename(tree), "ids": ids_readers(tree),
            "speculators_eagle3_arch_map": speculators_eagle3(tree),
            "shares_target_lm_head_without_own": "has_own_lm_head" in
            (tree.read("vllm/v1/worker/gpu/spec_decode/eagle/utils.py") or ""),
            "layers_setter": " ".join(m.group(1).split()) if m else None}
