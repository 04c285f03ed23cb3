"""vLLM's EAGLE-3 code, read from its source (a wheel or an installed tree) without importing vLLM.

A maintainer tool (``tools/``, not shipped): vLLM is not a dependency of this project; the table generator reads
the pinned wheel (``python -m tools.engine_tables vllm --wheel vllm-0.33.0-*.whl``) with the package's source
reader (``eagle3_ops/doctor/source_reader.py``). What is read:

- the whole model registry: every dict ``registry.py`` merges into ``_VLLM_MODELS`` (text generation, multimodal,
  pooling, speculative, and the Transformers-backend mappings ``_TRANSFORMERS_SUPPORTED_MODELS`` /
  ``_TRANSFORMERS_BACKEND_MODELS``), architecture -> (module, class), the later dict winning as in the merge; the
  dicts and their architectures are recorded in the table (``registry``) so a test can check every one has a row;
  an architecture the registry does not name goes to the Transformers backend class
  ``ModelConfig._get_transformers_backend_cls`` names (``transformers_fallback``);
- each class's bases, resolved through its module's imports: a target is served for EAGLE-3 when
  ``SupportsEagle3`` (``interfaces.py``) is among them (``eagle3_utils.set_eagle3_aux_hidden_state_layers``
  raises "Model does not support EAGLE3 interface" otherwise);
- the default ids (``get_eagle3_default_aux_hidden_state_layers``, the interface's or an override);
- the decoder model the class builds (``self.model = X(...)``) and, in its source, where captures are taken
  (``_maybe_add_hidden_state(aux, <index>, ...)`` / ``<index> in self.aux_hidden_state_layers``: the entry of
  layer ``idx``, after layer ``idx`` (``idx + 1``), the stage start, the end) and whether it relays captures
  across pipeline stages (``supports_aux_hidden_states_over_pp``);
- where each model runner reads the draft's ids (the config keys its function reads, in order);
- for a class that places its captures itself (the Transformers backend's ``Base.set_aux_hidden_state_layers``:
  an output recorder on ``self._layer_names[layer - 1]``), the layer each id records, the keys of that lookup
  (an id without a key raises ``KeyError``) and the order of its captures (``capture_order: written``: the loop
  walks the ids as written, where vLLM's own decoders keep ``tuple(sorted(set(layers)))``);
- the EAGLE-3 draft heads (speculative registry entries served from ``*eagle3*`` modules), the checkpoint tensors
  each head's ``load_weights`` loads into its decoder layer (:func:`head_layer`: the ``__init__`` chain and the
  name mapping, read with ast; the same reader reads SGLang's installed heads), and the architecture rename
  ``EAGLEConfig`` applies to a draft (``Eagle3{arch}``).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from eagle3_ops.doctor.source_reader import Index, Module, SourceTree, class_method, head_layer


MODELS = "vllm/model_executor/models/"


TARGET_REGISTRIES = ("_TEXT_GENERATION_MODELS", "_MULTIMODAL_MODELS")


def _comprehension(node: ast.DictComp, dicts: Dict[str, Dict[str, Tuple[str, str]]]):
    """``{k: (mod, arch) for k, (mod, arch) in X.items() if arch == "C"}`` over a dict already read; None for any
    other form (the caller records it as unread)."""
    gen = node.generators[0] if len(node.generators) == 1 else None
    if gen is None or not (isinstance(gen.iter, ast.Call) and isinstance(gen.iter.func, ast.Attribute) and
                           gen.iter.func.attr == "items" and isinstance(gen.iter.func.value, ast.Name) and
                           gen.iter.func.value.id in dicts):
        return None
    t = gen.target
    if not (isinstance(t, ast.Tuple) and len(t.elts) == 2 and isinstance(t.elts[0], ast.Name) and
            isinstance(t.elts[1], ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts[1].elts)):
        return None
    names = [t.elts[0].id] + [e.id for e in t.elts[1].elts]
    out = {}
    for k, v in dicts[gen.iter.func.value.id].items():
        env = dict(zip(names, (k,) + tuple(v)))
        ok = True
        for cond in gen.ifs:
            if not (isinstance(cond, ast.Compare) and len(cond.ops) == 1 and
                    isinstance(cond.ops[0], (ast.Eq, ast.NotEq))
                    and isinstance(cond.left, ast.Name) and cond.left.id in env and
                    isinstance(cond.comparators[0], ast.Constant)):
                return None
            same = env[cond.left.id] == cond.comparators[0].value
            ok = ok and (same if isinstance(cond.ops[0], ast.Eq) else not same)
        if not ok:
            continue
        if not (isinstance(node.key, ast.Name) and isinstance(node.value, ast.Tuple) and
                all(isinstance(e, ast.Name) and e.id in env for e in node.value.elts) and node.key.id in env):
            return None
        out[env[node.key.id]] = tuple(env[e.id] for e in node.value.elts)
    return out


MERGED_REGISTRY = "_VLLM_MODELS"


def registry_dicts(src: str) -> Tuple[List[str], Dict[str, Dict[str, Tuple[str, str]]], Dict[str, List[str]]]:
    """vLLM's model registry as registry.py builds it: the dicts ``_VLLM_MODELS`` merges (``**_X``, in order; a
    later dict wins for an architecture two of them name), each as architecture -> (module, class), in source
    order, and per dict the source of any entry this reader could not evaluate (it must stay empty)."""
    tree = ast.parse(src)
    dicts: Dict[str, Dict[str, Tuple[str, str]]] = {}
    unread: Dict[str, List[str]] = {}
    order: List[str] = []
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or not isinstance(node.value, ast.Dict):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        if not isinstance(target, ast.Name):
            continue
        name = target.id
        if name == MERGED_REGISTRY:
            order = [v.id for k, v in zip(node.value.keys, node.value.values) if k is None and isinstance(v, ast.Name)]
            unread[name] = [ast.unparse(v) for k, v in zip(node.value.keys, node.value.values)
                            if not (k is None and isinstance(v, ast.Name))]
            continue
        d: Dict[str, Tuple[str, str]] = {}
        bad: List[str] = []
        for k, v in zip(node.value.keys, node.value.values):
            if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) == 2 and \
                    all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts):
                d[k.value] = (v.elts[0].value, v.elts[1].value)
            elif k is None and isinstance(v, ast.DictComp) and _comprehension(v, dicts) is not None:
                d.update(_comprehension(v, dicts))
            elif k is None and isinstance(v, ast.Name) and v.id in dicts:
                d.update(dicts[v.id])
            else:
                bad.append(ast.unparse(v) if k is None else ast.unparse(k))
        dicts[name] = d
        unread[name] = bad
    if not order:  # an older registry without the merged dict: the two target dicts
        order = [r for r in TARGET_REGISTRIES if r in dicts]
    for n in order:
        if n not in dicts:
            unread[n] = [f"{n} is not a dict literal of registry.py"]
    return order, {n: dicts.get(n, {}) for n in order}, \
        {n: b for n, b in unread.items() if b and (n in order or n == MERGED_REGISTRY)}


def _module_path(mod: str) -> str:
    return MODELS + mod + ".py" if "." not in mod else mod.replace(".", "/") + ".py"


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


def _sources(m: Module, c: ast.ClassDef) -> List[str]:
    return [ast.get_source_segment(m.src, n) or "" for n in c.body if isinstance(n, ast.FunctionDef)]


def _inner_model(index: "Index", mro, registry: Dict[str, Tuple[str, str]], depth: int = 0):
    """The decoder model a ForCausalLM builds: ``self.model = X(...)``, ``self.model_cls(...)`` or
    ``self._init_model(...)`` returning it; for wrappers, the language model's (``init_vllm_registered_model(...,
    architectures=["X"])`` through the registry). Returns ((module, class) or None, how)."""
    def resolve(mm, fn):
        if fn.startswith("self."):
            attr = fn[5:]
            for m2, k in mro:
                meth = class_method(k, attr)
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
        init = class_method(cc, "__init__")
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
        init = class_method(cc, "__init__")
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


def own_capture(index: "Index", mro) -> Optional[dict]:
    """Captures a class places itself in ``set_aux_hidden_state_layers`` rather than in a vLLM decoder loop
    (vLLM's Transformers backend: ``for layer in layers: ... self._layer_names[layer - 1] ... OutputRecorder``):
    the layer whose output each id records, and which keys that lookup holds (an id outside them raises)."""
    hit = next(((m, c) for m, c in mro if c.name != "SupportsEagle3" and
                class_method(c, "set_aux_hidden_state_layers") is not None), None)
    if hit is None:
        return None
    m, c = hit
    fn = class_method(c, "set_aux_hidden_state_layers")
    params = [a.arg for a in fn.args.args[1:]]
    for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For) and isinstance(n.target, ast.Name) and
                 isinstance(n.iter, ast.Name) and n.iter.id in params):
        var = loop.target.id
        for sub in ast.walk(loop):
            if not (isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Attribute) and
                    ast.unparse(sub.value.value) == "self" and var in {x.id for x in ast.walk(sub.slice)
                                                                       if isinstance(x, ast.Name)}):
                continue
            attr, idx = sub.value.attr, ast.unparse(sub.slice)
            compact = idx.replace(" ", "")
            offset = 0 if compact == var else (int(compact[len(var) + 1:]) if re.fullmatch(
                re.escape(var) + r"-\d+", compact) else None)
            recorder = next((ast.unparse(x.func) for x in ast.walk(loop) if isinstance(x, ast.Call) and
                             ast.unparse(x.func).endswith("Recorder")), None)
            # the keys of the lookup: self.<attr>[int(child_name)] = ... (the indices of the layer ModuleList)
            keys = next((f"{cc.name}.{fn2.name}: {ast.unparse(a.targets[0])}" for _, cc in mro
                         for fn2 in cc.body if isinstance(fn2, ast.FunctionDef) for a in ast.walk(fn2)
                         if isinstance(a, ast.Assign) and isinstance(a.targets[0], ast.Subscript) and
                         ast.unparse(a.targets[0].value) == f"self.{attr}" and
                         ast.unparse(a.targets[0].slice).startswith("int(")), None)
            kind = "after" if offset == 1 else (f"other:{compact}" if offset is None else f"output-of:{compact}")
            # The loop walks the ids as written (no sorted(set(...)) as in vLLM's own decoders): each id adds
            # a recorder keyed by the id to the model's _can_record_outputs, and transformers returns the
            # recorded outputs in that key order (a repeated id is the same key: recorded once, first place).
            return {"capture": [{"boundary": kind, "index": idx, "value": "layer-output"}],
                    "capture_order": "written",
                    "captured_by": f"{c.name}.set_aux_hidden_state_layers" + (f" ({recorder} on the output of "
                                                                            f"self.{attr}[{idx}])" if recorder else ""),
                    "id_lookup": {"code": f"self.{attr}[{idx}]", "offset": offset, "keys_from": keys}}
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
                     class_method(c, "get_eagle3_default_aux_hidden_state_layers") is not None), None)
    iface = next(((m, c) for m, c in mro if c.name == "SupportsEagle3"), None)
    src_default = override or iface
    row["default"] = _first_return(class_method(src_default[1], "get_eagle3_default_aux_hidden_state_layers")) \
        if src_default else None
    row["default_from"] = src_default[1].name if src_default else None
    if (row["default"] or "").startswith("self.language_model."):  # a wrapper asking its language model
        lm = _language_model(index, mro, registry)
        row["default_delegated_to"] = lm[1].name if lm else None
        row["default"] = None
        if lm is not None:
            lmro = index.mro(lm[0].rel, lm[1].name)
            hit = next(((m, c) for m, c in lmro if class_method(c, "get_eagle3_default_aux_hidden_state_layers")), None)
            row["default"] = _first_return(class_method(hit[1], "get_eagle3_default_aux_hidden_state_layers")) \
                if hit else None
    setter = next((c.name for m, c in mro if class_method(c, "set_aux_hidden_state_layers") is not None), None)
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
        own_setter = next((cc.name for _, cc in imro if class_method(cc, "_set_aux_hidden_state_layers")), None)
        row["layers_setter"] = own_setter
    else:
        row["decoder"], row["capture"], row["pp_relay"] = None, [], False
        own = own_capture(index, mro)
        if own is not None:  # the class records the layers' outputs itself (the Transformers backend)
            row.update(own)
            row["decoder_how"] = f"captures in {own['captured_by']}"
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


SPECULATIVE_REGISTRY = "_SPECULATIVE_DECODING_MODELS"


def suffix_runners(tree: SourceTree) -> List[Tuple[str, str]]:
    """(architecture suffix, runner) in the order vLLM tries them when the runner is "auto"
    (``config/model.py: _SUFFIX_TO_DEFAULTS``)."""
    src = tree.read("vllm/config/model.py") or ""
    for node in ast.parse(src).body if src else ():
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            t = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(t, ast.Name) and t.id == "_SUFFIX_TO_DEFAULTS" and node.value is not None:
                try:
                    return [(suf, runner) for suf, (runner, _) in ast.literal_eval(node.value)]
                except (ValueError, TypeError):
                    return []
    return []


def transformers_fallback(tree: SourceTree) -> Optional[dict]:
    """How vLLM names its Transformers-backend class for an architecture it does not register
    (``ModelConfig._get_transformers_backend_cls``: "Transformers" + "MultiModal" for a nested config + "MoE" +
    "ForCausalLM" for the generate runner), read from config/model.py."""
    src = tree.read("vllm/config/model.py")
    fn = next((n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and
               n.name == "_get_transformers_backend_cls"), None) if src else None
    if fn is None:
        return None
    parts = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str):
            parts.append(("base", n.value.value))
        elif isinstance(n, ast.AugAssign):
            v = n.value.body if isinstance(n.value, ast.IfExp) else n.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                test = ast.unparse(n.value.test) if isinstance(n.value, ast.IfExp) else None
                parts.append((test, v.value))
    base = next((v for k, v in parts if k == "base"), None)
    mm = next((v for k, v in parts if k and "hf_text_config" in k), None)
    moe = next((v for k, v in parts if k and "is_moe" in k), None)
    lm = next((v for k, v in parts if k is None and v.endswith("ForCausalLM")), None)
    if not (base and lm):
        return None
    return {"function": "ModelConfig._get_transformers_backend_cls", "text": base + lm,
            "multimodal": base + (mm or "") + lm, "moe": base + (moe or "") + lm,
            "multimodal_moe": base + (mm or "") + (moe or "") + lm,
            "resolver": "ModelRegistry._try_resolve_transformers"}


# What an EAGLE-3 head reads to size its fc, in the order its __init__ reads them (the first one set wins):
# ``getattr(self.config, KEY, None)`` of a top-level key, ``eagle_config.get(KEY)`` of an eagle_config key (a list of
# ids counts its length), and ``... else N``, the default count.
_FC_READS = re.compile(r"getattr\(\s*self\.config,\s*[\"'](num_aux_layers|num_aux_hidden_states|"
                       r"eagle_aux_hidden_state_layer_ids)[\"']"
                       r"|eagle_config\.get\(\s*[\"'](eagle_aux_hidden_state_layer_ids)[\"']\s*\)"
                       r"|if (?:layer_ids|aux_ids) else (\d+)")


def fc_slots_from(src: str) -> Optional[list]:
    """The keys a head's module reads, in order, to size its fc (``eagle_config.X`` for an eagle_config key), then
    the default count; None when its source does not read them as :data:`_FC_READS` knows."""
    out: list = []
    for top, nested, default in _FC_READS.findall(src):
        if default:
            out.append(int(default))
            break
        key = top or f"eagle_config.{nested}"
        if key not in out:
            out.append(key)
    return out if out and isinstance(out[-1], int) else None


def table(path) -> dict:
    tree = SourceTree(path)
    index = Index(tree)
    order, regs, unread = registry_dicts(tree.read(MODELS + "registry.py"))
    merged: Dict[str, Tuple[str, str]] = {}
    source: Dict[str, str] = {}
    for reg in order:  # the merge _VLLM_MODELS does: a later dict wins
        for arch, v in regs[reg].items():
            merged[arch] = v
            source[arch] = reg
    targets = {}
    runners = suffix_runners(tree)
    for arch, (mod, name) in sorted(merged.items()):
        row = dict(describe_target(index, arch, mod, name, merged), registry=source[arch])
        row["default_runner"] = next((r for suffix, r in runners if arch.endswith(suffix)), None)
        if source[arch] == SPECULATIVE_REGISTRY:
            # vLLM registers these as speculative (draft) models: a draft head or MTP module, never the target
            row = {"class": row["class"], "registry": source[arch], "default_runner": row["default_runner"],
                   "supported": False,
                   "reason": f"{arch} is registered in {SPECULATIVE_REGISTRY}: vLLM builds it as the speculative "
                             f"(draft) model, not as a target that captures hidden states"}
        targets[arch] = row
    heads = {}
    for arch, (mod, name) in sorted(regs.get(SPECULATIVE_REGISTRY, {}).items()):
        if "eagle3" in mod:
            src = tree.read(_module_path(mod)) or ""
            heads[arch] = {"class": f"{mod}.{name}", "reads_tie_word_embeddings": "tie_word_embeddings" in src,
                           "lm_head_rows": "draft_vocab_size"
                           if re.search(r"ParallelLMHead\(\s*self\.config\.draft_vocab_size", src) else None,
                           "layer": head_layer(index, _module_path(mod), name), "fc_slots_from": fc_slots_from(src)}
    iface = tree.read(MODELS + "interfaces.py") or ""
    m = re.search(r"def _set_aux_hidden_state_layers\(.*?\n(.*?)\n\n", iface, re.S)
    return {"engine": "vllm", "version": tree.version(), "source": Path(path).name, "targets": targets,
            "registry": {"merged_into": MERGED_REGISTRY, "order": order,
                         "dicts": {r: list(regs[r]) for r in order}, "unread": unread},
            "transformers_fallback": transformers_fallback(tree),
            "draft_heads": heads, "draft_rename": draft_rename(tree), "ids": ids_readers(tree),
            "speculators_eagle3_arch_map": speculators_eagle3(tree),
            "shares_target_lm_head_without_own": "has_own_lm_head" in
            (tree.read("vllm/v1/worker/gpu/spec_decode/eagle/utils.py") or ""),
            "layers_setter": " ".join(m.group(1).split()) if m else None}
