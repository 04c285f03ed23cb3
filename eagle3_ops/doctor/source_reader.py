"""An engine's model sources read with ``ast``, never imported: the reader the doctor uses on the installed
SGLang at run time (which checkpoint tensors each EAGLE-3 head's ``load_weights`` loads into its decoder layer:
``sglang_code.draft_head``), and the one the maintainer tool ``tools/vllm_tables.py`` reads the pinned vLLM wheel
with.

- :class:`SourceTree`: a source tree (a directory or a wheel); :class:`Index`: its modules parsed, classes resolved
  through each module's imports (``TYPE_CHECKING``-only imports left out);
- :func:`head_layer`: the parameters a head's decoder layer builds (its ``__init__`` chain, :class:`LayerReader`)
  and the checkpoint names its ``load_weights`` maps onto them (:func:`name_rewrites`, :func:`checkpoint_names`);
- :func:`layer_fit`: how a checkpoint's decoder-layer tensors fit such a record.
"""
from __future__ import annotations

import ast
import re
import zipfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple


class SourceTree:
    """Python sources of a vLLM wheel (zip) or an unpacked tree, by path inside the package root."""

    def __init__(self, path):
        self.path = Path(path)
        self._zip = zipfile.ZipFile(self.path) if self.path.is_file() else None
        self._cache: Dict[str, Optional[str]] = {}

    def read(self, rel: str) -> Optional[str]:
        """The text of file ``rel`` (a path inside the tree), or None when it is not there or cannot be read; each file
        is read once."""
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
        """The vLLM version its ``vllm/_version.py`` declares, or None."""
        src = self.read("vllm/_version.py") or ""
        m = re.search(r"""__version__\s*=\s*version\s*=\s*['"]([^'"]+)""", src) or \
            re.search(r"""__version__\s*=\s*['"]([^'"]+)""", src)
        return m.group(1) if m else None


def _type_checking_only(tree: ast.Module) -> set:
    """Nodes under a module-level ``if TYPE_CHECKING:`` body: stubs for type checkers, not what runs."""
    out = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test).split(".")[-1] == "TYPE_CHECKING":
            for stmt in node.body:
                out.update(ast.walk(stmt))
    return out


class Module:
    """One parsed source file: its classes by name, its ``from`` imports (local name -> (file, name), relative ones
    resolved) and module-level name aliases; ``ast`` None for a missing or empty file."""

    def __init__(self, tree: SourceTree, rel: str):
        self.rel = rel
        self.src = tree.read(rel)
        self.ast = ast.parse(self.src) if self.src else None
        self.classes: Dict[str, ast.ClassDef] = {}
        self.imports: Dict[str, Tuple[str, str]] = {}  # local name -> (module path, name)
        self.aliases: Dict[str, str] = {}  # module-level ``Name = Other`` (the runtime side of TYPE_CHECKING)
        if self.ast is None:
            return
        pkg = rel.rsplit("/", 1)[0]
        stubs = _type_checking_only(self.ast)
        for node in ast.walk(self.ast):
            if node in stubs and not isinstance(node, ast.ImportFrom):  # its imports still name real classes
                continue
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
        for node in self.ast.body:
            stmts = node.orelse if isinstance(node, ast.If) else [node]
            for st in stmts:
                if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name) and \
                        isinstance(st.value, ast.Name) and st.targets[0].id not in self.classes:
                    self.aliases[st.targets[0].id] = st.value.id


class Index:
    """Classes of vLLM's model modules with their bases resolved across modules."""

    def __init__(self, tree: SourceTree):
        self.tree = tree
        self._mods: Dict[str, Module] = {}

    def module(self, rel: str) -> Module:
        """The :class:`Module` of file ``rel`` (a package's ``__init__.py`` when ``rel`` names a package), parsed
        once."""
        if self.tree.read(rel) is None and self.tree.read(rel[:-3] + "/__init__.py") is not None:
            rel = rel[:-3] + "/__init__.py"  # a package (the registry names "transformers": transformers/)
        if rel not in self._mods:
            self._mods[rel] = Module(self.tree, rel)
        return self._mods[rel]

    def find(self, rel: str, name: str, depth: int = 0) -> Optional[Tuple[Module, ast.ClassDef]]:
        """Where class ``name`` as file ``rel`` sees it is defined: (module, class node), following aliases and imports
        (at most 6 hops), or None."""
        m = self.module(rel)
        if name in m.classes:
            return m, m.classes[name]
        if name in m.aliases and depth < 6:
            return self.find(rel, m.aliases[name], depth + 1)
        if name in m.imports and depth < 6:
            mod, real = m.imports[name]
            if self.tree.read(mod) is None:  # a package: its __init__.py
                mod = mod[:-3] + "/__init__.py"
            return self.find(mod, real, depth + 1)
        return None

    def mro(self, rel: str, name: str) -> List[Tuple[Module, ast.ClassDef]]:
        """Class ``name`` of file ``rel`` and its bases found in the tree, depth first, each once (the bases the tree
        does not hold are left out)."""
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
                if bn and bn == c.name and bn in m.imports:  # class X(X): the imported X it shadows
                    mod, real = m.imports[bn]
                    visit(mod if self.tree.read(mod) is not None else mod[:-3] + "/__init__.py", real, depth + 1)
                elif bn:
                    visit(m.rel, bn, depth + 1)
        visit(rel, name, 0)
        return out


def class_method(cls: ast.ClassDef, name: str) -> Optional[ast.FunctionDef]:
    """The method ``name`` defined directly in class node ``cls`` (not inherited), or None."""
    return next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


# --------------------------------------------------------------------------- a draft head's layer tensors
# Read with ast from an engine's sources (the vLLM wheel here; SGLang's installed files through sglang_code), so
# that the doctor can tell which EAGLE-3 head loads a checkpoint's decoder layer without a hand-written list.
_UNKNOWN = object()


def _is_ref(v) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], ast.ClassDef)


def _self_path(expr: ast.AST, aliases: Dict[str, str]) -> Optional[str]:
    """``self.a.b`` -> "a.b"; ``x.b`` where ``x = self.a`` -> "a.b"; else None."""
    parts = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    if expr.id == "self":
        root = []
    elif expr.id in aliases:
        root = aliases[expr.id].split(".")
    else:
        return None
    return ".".join(root + parts[::-1]) or None


class LayerReader:
    """The parameters a module class builds, read from its ``__init__`` chain: ``self.x = Class(...)`` (recursively,
    ``nn.ModuleList([Class(...) ...])`` as element 0), ``nn.Parameter``, ``register_parameter``, and a linear
    layer's ``self.quant_method = Unquantized...()`` + ``quant_method.create_weights(self)`` (the parameters that
    method registers). A parameter is conditional when it sits under an ``if`` whose test does not follow from
    the constants the call passes (or the defaults); a later assignment replaces what a base class built."""

    def __init__(self, index: "Index"):
        self.index = index
        self.visited: List[Tuple[str, str]] = []  # (module, class) of every module built, for its load_weights

    # ---- values
    def _bind(self, m: Module, fn: ast.FunctionDef, args, kwargs) -> Dict[str, object]:
        a = fn.args
        names = [x.arg for x in a.posonlyargs + a.args][1:]  # without self
        out: Dict[str, object] = {}
        defaults = a.defaults
        for n, d in zip(names[len(names) - len(defaults):], defaults):
            out[n] = self._const_or_class(m, d)
        for k, d in zip(a.kwonlyargs, a.kw_defaults):
            if d is not None:
                out[k.arg] = self._const_or_class(m, d)
        for n, v in zip(names, args):
            out[n] = v
        for k, v in (kwargs or {}).items():
            out[k] = v
        return out

    def _const_or_class(self, m: Module, node: ast.AST):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return self.index.find(m.rel, node.id) or _UNKNOWN
        return _UNKNOWN

    # ---- the walk
    def params(self, rel: str, name: str, args=(), kwargs=None, stack=()) -> Dict[str, bool]:
        """Parameter path -> conditional, for the class ``name`` of module ``rel`` built with these arguments."""
        key = (rel, name)
        if key in stack or len(stack) > 12:
            return {}
        hit = self.index.find(rel, name)
        if hit is None:
            return {}
        self.visited.append((hit[0].rel, hit[1].name))
        mro = self.index.mro(hit[0].rel, hit[1].name)
        return self._init(mro, 0, list(args), dict(kwargs or {}), stack + (key,))[0]

    def _init(self, mro, i, args, kwargs, stack) -> Tuple[Dict[str, bool], list]:
        obj = {"params": {}, "quant": [], "selfv": {}}
        self._run(mro, i, "__init__", args, kwargs, stack, obj, False)
        return obj["params"], obj["quant"]

    def _run(self, mro, i, meth, args, kwargs, stack, obj, cond, calls=0) -> bool:
        """Run the first ``meth`` of ``mro[i:]`` on the object being built (``obj``: what it holds so far)."""
        j = next((k for k in range(i, len(mro)) if class_method(mro[k][1], meth) is not None), None)
        if j is None:
            return False
        m, c = mro[j]
        fn = class_method(c, meth)
        st = {"m": m, "bound": self._bind(m, fn, args, kwargs), "alias": {}, "classes": {}, "mro": mro, "j": j,
              "stack": stack, "calls": calls, "params": obj["params"], "quant": obj["quant"],
              "selfv": obj["selfv"], "obj": obj}
        self._body(fn.body, cond, st)
        return True

    def _val(self, e: ast.AST, st) -> object:
        if isinstance(e, ast.Constant):
            return e.value
        if isinstance(e, ast.Name):
            if e.id in st["bound"]:
                return st["bound"][e.id]
            return self.index.find(st["m"].rel, e.id) or _UNKNOWN
        p = _self_path(e, {})
        if p is not None and p in st["selfv"]:
            return st["selfv"][p]
        return _UNKNOWN

    def _test(self, e: ast.AST, st) -> Optional[bool]:
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            v = self._test(e.operand, st)
            return None if v is None else not v
        if isinstance(e, ast.BoolOp):
            vals = [self._test(x, st) for x in e.values]
            if isinstance(e.op, ast.And):
                return False if False in vals else (None if None in vals else True)
            return True if True in vals else (None if None in vals else False)
        if isinstance(e, ast.Compare) and len(e.ops) == 1 and \
                isinstance(e.ops[0], (ast.Is, ast.IsNot, ast.Eq, ast.NotEq)):
            a, b = self._val(e.left, st), self._val(e.comparators[0], st)
            if a is _UNKNOWN or b is _UNKNOWN or _is_ref(a) or _is_ref(b):
                return None
            same = a is b if isinstance(e.ops[0], (ast.Is, ast.IsNot)) else a == b
            return same if isinstance(e.ops[0], (ast.Is, ast.Eq)) else not same
        v = self._val(e, st) if isinstance(e, (ast.Constant, ast.Name, ast.Attribute)) else _UNKNOWN
        return None if v is _UNKNOWN or _is_ref(v) else bool(v)

    def _classes(self, e: ast.AST, st) -> Tuple[list, bool]:
        """The classes an expression names (a local, a parameter, an import; both sides of ``a if t else b``)."""
        if isinstance(e, ast.IfExp):
            a, _ = self._classes(e.body, st)
            b, _ = self._classes(e.orelse, st)
            return a + b, True
        if isinstance(e, ast.Name):
            if e.id in st["classes"]:
                return st["classes"][e.id]
            v = self._val(e, st)
            return ([v], False) if _is_ref(v) else ([], False)
        return [], False

    def _body(self, stmts, cond: bool, st) -> None:
        for s in stmts:
            if isinstance(s, ast.If):
                t = self._test(s.test, st)
                if t is not False:
                    self._body(s.body, cond or t is None, st)
                if t is not True:
                    self._body(s.orelse, cond or t is None, st)
            elif isinstance(s, (ast.For, ast.While, ast.AsyncFor)):
                self._body(s.body + s.orelse, True, st)
            elif isinstance(s, (ast.With, ast.AsyncWith)):
                self._body(s.body, cond, st)
            elif isinstance(s, ast.Try):
                self._body(s.body + s.orelse + s.finalbody, cond, st)
                for h in s.handlers:
                    self._body(h.body, True, st)
            elif isinstance(s, (ast.Assign, ast.AnnAssign)) and s.value is not None:
                t = s.targets[0] if isinstance(s, ast.Assign) else s.target
                self._assign(t, s.value, cond, st)
            elif isinstance(s, ast.Expr) and isinstance(s.value, ast.Call):
                self._call(s.value, cond, st)

    def _args(self, call: ast.Call, st):
        args = [self._val(a, st) for a in call.args if not isinstance(a, ast.Starred)]
        return args, {k.arg: self._val(k.value, st) for k in call.keywords if k.arg}

    def _call(self, call: ast.Call, cond: bool, st) -> None:
        f = call.func
        fname = ast.unparse(f)
        if isinstance(f, ast.Attribute) and f.attr == "__init__":
            mro, j = st["mro"], st["j"]
            nxt = None
            if isinstance(f.value, ast.Call) and ast.unparse(f.value.func) == "super":
                sargs = f.value.args
                if sargs and isinstance(sargs[0], ast.Name):  # super(X, self): the class after X
                    nxt = next((k + 1 for k in range(len(mro)) if mro[k][1].name == sargs[0].id), None)
                else:
                    nxt = j + 1
            elif isinstance(f.value, ast.Name):  # Base.__init__(self, ...): that class, if it is one of ours
                nxt = next((k for k in range(len(mro)) if mro[k][1].name == f.value.id), None)
            if nxt is None:
                return
            args, kwargs = self._args(call, st)
            if fname != "super().__init__" and not fname.startswith("super("):
                args = args[1:]  # the explicit self
            self._run(mro, nxt, "__init__", args, kwargs, st["stack"], st["obj"], cond, st["calls"])
        elif st["calls"] < 4 and isinstance(f, ast.Attribute) and (
                ast.unparse(f.value) in ("self", "super()")) and f.attr != "create_weights":
            # a helper of __init__ (self._initialize_partition(...)) builds parts of the same object
            mro, j = st["mro"], st["j"]
            args, kwargs = self._args(call, st)
            start = j + 1 if ast.unparse(f.value) == "super()" else 0
            self._run(mro, start, f.attr, args, kwargs, st["stack"], st["obj"], cond, st["calls"] + 1)
        if isinstance(f, ast.Attribute) and f.attr == "create_weights" and st["quant"]:
            for _qm, qc in st["quant"]:
                meth = class_method(qc, "create_weights")
                for n in ast.walk(meth) if meth is not None else ():
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                            n.func.attr == "register_parameter" and len(n.args) > 1 and \
                            isinstance(n.args[0], ast.Constant) and \
                            not (isinstance(n.args[1], ast.Constant) and n.args[1].value is None):
                        st["params"][n.args[0].value] = cond
        elif isinstance(f, ast.Attribute) and f.attr == "register_parameter" and call.args and \
                isinstance(call.args[0], ast.Constant) and ast.unparse(f.value) == "self" and \
                not (len(call.args) > 1 and isinstance(call.args[1], ast.Constant) and call.args[1].value is None):
            # register_parameter("bias", None) declares that there is none
            st["params"][call.args[0].value] = cond

    def _assign(self, t: ast.AST, v: ast.AST, cond: bool, st) -> None:
        if isinstance(t, ast.Name):
            path = _self_path(v, st["alias"]) if isinstance(v, ast.Attribute) else None
            refs, either = self._classes(v, st)
            if path is not None:
                st["alias"][t.id] = path
            elif refs:
                st["classes"][t.id] = (refs, either)
            else:
                st["bound"][t.id] = self._val(v, st)
            return
        path = _self_path(t, st["alias"])
        if path is None:
            return
        calls = [(v, cond)] if isinstance(v, ast.Call) else \
            [(x, True) for x in (v.body, v.orelse) if isinstance(x, ast.Call)] if isinstance(v, ast.IfExp) else []
        if not calls:
            st["selfv"][path] = self._val(v, st)
            return
        built: Dict[str, bool] = {}
        module = False
        for call, c in calls:
            fname = ast.unparse(call.func)
            last = fname.split(".")[-1]
            if last == "Parameter":
                built[""] = c
                module = True
                continue
            if last == "ModuleList":  # a stack of layers: element 0 stands for it
                arg = call.args[0] if call.args else None
                elt = arg.elt if isinstance(arg, ast.ListComp) else \
                    (arg.elts[0] if isinstance(arg, ast.List) and arg.elts else None)
                if isinstance(elt, ast.Call):
                    refs, either = self._classes(elt.func, st)
                    if not refs and isinstance(elt.func, ast.Name):
                        hit = self.index.find(st["m"].rel, elt.func.id)
                        refs = [hit] if hit else []
                    for rm, rc in refs:
                        a, k = self._args(elt, st)
                        for p, pc in self.params(rm.rel, rc.name, a, k, st["stack"]).items():
                            built[f"0.{p}"] = pc or c or either
                module = True
                continue
            refs, either = self._classes(call.func, st)
            if not refs and isinstance(call.func, ast.Name):
                hit = self.index.find(st["m"].rel, call.func.id)
                refs = [hit] if hit else []
            if path.split(".")[-1] == "quant_method":  # the linear method whose create_weights builds the weight
                st["quant"] += refs
                return
            for rm, rc in refs:
                module = True
                a, k = self._args(call, st)
                for p, pc in self.params(rm.rel, rc.name, a, k, st["stack"]).items():
                    built[p] = pc or c or either
        if not module:
            return
        for p in [p for p in st["params"] if p == path or p.startswith(path + ".")]:
            del st["params"][p]  # rebuilt: what the base class put there is gone
        for p, c in built.items():
            st["params"][f"{path}.{p}" if p else path] = c


def _unescape(pattern: str) -> Optional[str]:
    """A regex that only matches a literal string (escaped dots): that string."""
    lit = re.sub(r"\\(.)", r"\1", pattern)
    return lit if re.escape(lit).replace("\\.", ".") == pattern.replace("\\.", ".") else None


def name_rewrites(fn_or_expr: ast.AST) -> List[Tuple[str, str, str]]:
    """How a ``load_weights`` (or a ``WeightsMapper(...)``) turns checkpoint names into parameter names:
    (checkpoint text, parameter text, kind) with kind ``substr`` (replaced anywhere) or ``prefix`` (at the start;
    checkpoint text "" = a prefix added, e.g. ``f"model.{name}"``)."""
    out = []

    def strs(*nodes):
        return all(isinstance(n, ast.Constant) and isinstance(n.value, str) for n in nodes)

    for n in ast.walk(fn_or_expr):
        if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name):
            tid = n.targets[0].id
            if "stacked_params_mapping" in tid and isinstance(n.value, (ast.List, ast.Tuple)):
                for e in n.value.elts:  # (param_name, weight_name, shard_id)
                    if isinstance(e, ast.Tuple) and len(e.elts) >= 2 and strs(e.elts[0], e.elts[1]):
                        out.append((e.elts[1].value, e.elts[0].value, "substr"))
            elif tid.endswith(("_map", "_mapping")) and isinstance(n.value, ast.Dict):
                for k, v in zip(n.value.keys, n.value.values):
                    if k is not None and strs(k, v):
                        out.append((k.value, v.value, "substr"))
        elif isinstance(n, ast.Call):
            f = ast.unparse(n.func)
            if f.endswith(".replace") and len(n.args) == 2 and strs(*n.args):
                out.append((n.args[0].value, n.args[1].value, "substr"))
            elif f in ("re.sub", "sub") and len(n.args) >= 2 and strs(n.args[0], n.args[1]) and \
                    n.args[0].value.startswith("^"):
                lit = _unescape(n.args[0].value[1:])
                if lit is not None:
                    out.append((lit, n.args[1].value, "prefix"))
            elif f.split(".")[-1] == "WeightsMapper":
                for kw in n.keywords:
                    if not isinstance(kw.value, ast.Dict):
                        continue
                    for k, v in zip(kw.value.keys, kw.value.values):
                        if k is None or not strs(k):
                            continue
                        if kw.arg == "orig_to_new_stacked" and isinstance(v, ast.Tuple) and v.elts and \
                                strs(v.elts[0]):
                            out.append((k.value, v.elts[0].value, "substr"))
                        elif kw.arg in ("orig_to_new_substr", "orig_to_new_prefix") and strs(v):
                            out.append((k.value, v.value, "substr" if kw.arg.endswith("substr") else "prefix"))
        elif isinstance(n, ast.JoinedStr) and n.values and strs(n.values[0]) and len(n.values) == 2 and \
                isinstance(n.values[1], ast.FormattedValue):
            out.append(("", n.values[0].value, "prefix"))
        elif isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add) and strs(n.left) and \
                isinstance(n.right, ast.Name):
            out.append(("", n.left.value, "prefix"))
    return list(dict.fromkeys(out))


def _whole(s: str, part: str) -> bool:
    """``part`` occurs in ``s`` as whole dotted name parts (``q_a_proj`` is not in ``fused_qkv_a_proj``)."""
    return re.search(("" if part.startswith(".") else r"(?:^|(?<=\.))") + re.escape(part) +
                     ("" if part.endswith(".") else r"(?=\.|$)"), s) is not None


def checkpoint_names(param: str, rewrites: List[Tuple[str, str, str]], depth: int = 5) -> List[str]:
    """Every checkpoint name that the rewrites turn into ``param`` (the rewrites run backwards)."""
    seen, frontier = {param}, [param]
    for _ in range(depth):
        nxt = []
        for s in frontier:
            for ck, pa, kind in rewrites:
                if kind == "substr" and pa and _whole(s, pa):
                    cands = [s.replace(pa, ck)]
                elif kind == "prefix" and s.startswith(pa):
                    cands = [ck + s[len(pa):]]
                else:
                    cands = []
                for c in cands:
                    if c and c not in seen:
                        seen.add(c)
                        nxt.append(c)
        frontier = nxt
    return sorted(seen)


LAYER = "layers.0."  # the doctor's canonical name of a draft's decoder layer (midlayer. -> layers.0.)


def head_layer(index: "Index", rel: str, name: str) -> dict:
    """What a draft head loads into its decoder layer: each parameter (its path in the head) with the checkpoint
    tensor names (relative to ``layers.0.``) that its ``load_weights`` maps onto it, and whether the parameter
    is only built under a condition. Read from the head's ``__init__`` chain and the name mapping of every
    ``load_weights`` (and ``hf_to_vllm_mapper``) of the modules it builds."""
    reader = LayerReader(index)
    params = reader.params(rel, name)
    rewrites = []
    for mrel, cname in dict.fromkeys(reader.visited):
        mro = index.mro(mrel, cname)
        lw = next((c for _, c in mro if class_method(c, "load_weights") is not None), None)
        if lw is not None:
            rewrites += name_rewrites(class_method(lw, "load_weights"))
        mapper = next((n for _, c in mro for n in c.body if isinstance(n, ast.Assign) and
                       isinstance(n.targets[0], ast.Name) and n.targets[0].id == "hf_to_vllm_mapper"), None)
        if mapper is not None:
            rewrites += name_rewrites(mapper.value)
    rewrites = list(dict.fromkeys(rewrites))
    out = {}
    for p, cond in sorted(params.items()):
        names = [n[len(LAYER):] for n in checkpoint_names(p, rewrites) if n.startswith(LAYER)]
        if names:
            out[p] = {"from": names, "conditional": cond}
    return {"params": out, "name_rewrites": [list(r) for r in sorted(rewrites)]}


def layer_fit(layer: Optional[dict], tensors) -> Optional[dict]:
    """How a checkpoint's decoder-layer tensors (names relative to ``layers.N.``) fit a head's ``layer`` record:
    ``unloaded`` (tensors the head loads nowhere), ``missing`` (parameters it always builds that no tensor feeds);
    a fit has neither. None when the record is absent."""
    if not layer or not layer.get("params"):
        return None
    tensors = set(tensors)
    accepted = {n for v in layer["params"].values() for n in v["from"]}
    missing = [p for p, v in layer["params"].items() if not v["conditional"] and not tensors & set(v["from"])]
    return {"unloaded": sorted(tensors - accepted), "missing": sorted(missing),
            "fits": bool(tensors) and not (tensors - accepted) and not missing}
