"""The installed SGLang answers: which class serves a config, and what its EAGLE-3 capture code does.

Nothing here holds a copy of SGLang's rules. With SGLang importable:

- the target class is SGLang's own resolution (``ModelRegistry`` keyed by the classes' names, the
  first of ``architectures`` that it registers, else its Transformers fallback, as
  ``model_loader.utils.get_model_architecture`` does);
- the id -> boundary rule is learned by *running* that class's ``set_eagle3_layers_to_capture`` on a
  stand-in object (no model is built): the stand-in has the real config, a pipeline group, and
  children standing in for the sub-models the class's ``__init__`` assigns (``self.model``,
  ``self.language_model``; their classes read from the ``__init__`` source), and it records what the
  method sets (``layers_to_capture``, per-layer ``_is_layer_to_capture`` flags) or raises;
- where those boundaries are captured (the entry of layer ``i``, the final norm) and what is captured
  there is read from the capturing model's source (:mod:`.source_scan`);
- the draft heads are the registered classes whose module reads the target's captures
  (``spec_info.hidden_states``) through an ``fc`` sized by ``num_aux_hidden_states``; for each, the checkpoint
  tensors its ``load_weights`` loads into its decoder layer, read from its source (``head_layer``).

``describe_class`` is what the table generator writes (``tables/sglang-<version>.json``) and what the
doctor uses when SGLang is installed; ``tests/doctor/test_engine_tables.py`` checks the two agree.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import inspect
import re
import logging
import types
import warnings
from typing import Any, Dict, List, Optional, Tuple

from . import source_reader, source_scan

PINNED_VERSION = "0.5.23"
CHILD_ATTRS = ("model", "language_model", "llm")
_MISSING = object()


def installed_version() -> Optional[str]:
    """The installed SGLang's version (its distribution metadata; SGLang is not imported), or None when it is not
    installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return None
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


@contextlib.contextmanager
def quiet_sglang():
    """SGLang logs and warns while its model modules import (platform notes): keep the doctor's output clean."""
    root = logging.getLogger()
    old = root.level
    loggers = [logging.getLogger(n) for n in ("sglang", "sglang.srt", "sglang.srt.models.registry")]
    olds = [lg.level for lg in loggers]
    root.setLevel(logging.ERROR)
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        root.setLevel(old)
        for lg, lv in zip(loggers, olds):
            lg.setLevel(lv)


@functools.lru_cache(maxsize=None)
def registry() -> Dict[str, type]:
    """SGLang's ModelRegistry (architecture name -> class). Importing it imports every model module (slow:
    tens of seconds on a small CPU machine), so it is done once per process."""
    with quiet_sglang():
        from sglang.srt.models.registry import ModelRegistry

        return dict(ModelRegistry.models)


def resolve_architecture(architectures: List[str]) -> Tuple[Optional[type], str, str]:
    """(class or None, resolved name, how) the way SGLang's get_model_architecture picks the class."""
    models = registry()
    archs = [a for a in architectures if isinstance(a, str)]
    if not archs:
        return None, "", "the config lists no architectures"
    if any(a in models for a in archs):
        with quiet_sglang():
            from sglang.srt.models.registry import ModelRegistry

            cls, arch = ModelRegistry.resolve_model_cls(archs)
        return cls, arch, f"ModelRegistry.resolve_model_cls({archs})"
    return None, "TransformersForCausalLM", (f"none of {archs} is an SGLang model class: get_model_architecture "
                                             f"falls back to its Transformers backend")


# ----------------------------------------------------------------------------------------- stand-ins
class RecordingConfig:
    """A config that answers ``num_hidden_layers`` and sub-configs, and records which path was read (for the
    table, where no real config exists)."""

    def __init__(self, num_layers: int, path: str = "config", reads: Optional[list] = None):
        object.__setattr__(self, "_l", num_layers)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_reads", reads if reads is not None else [])

    def __getattr__(self, name):
        if name in ("text_config", "language_config", "llm_config"):
            return RecordingConfig(self._l, f"{self._path}.{name}", self._reads)
        if name == "get_text_config":
            return lambda *a, **k: RecordingConfig(self._l, f"{self._path}.get_text_config()", self._reads)
        if name == "num_hidden_layers":
            self._reads.append(f"{self._path}.num_hidden_layers")
            return self._l
        raise AttributeError(name)

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)


def _resolve_name(expr: ast.AST, env: dict, params: dict, overrides: dict, cls: Optional[type] = None, depth: int = 0):
    """The object an expression of an ``__init__`` names: a global, a parameter's default (or what a subclass
    passes for it), ``self.<class attribute>``, or what ``self.<method>(...)`` returns (``return X(...)``)."""
    if isinstance(expr, ast.Name):
        if expr.id in overrides:
            return overrides[expr.id]
        p = params.get(expr.id)
        if p is not None and p.default is not inspect.Parameter.empty:
            return p.default
        return env.get(expr.id, _MISSING)
    if isinstance(expr, ast.Attribute):
        if isinstance(expr.value, ast.Name) and expr.value.id == "self" and cls is not None:
            attr = inspect.getattr_static(cls, expr.attr, _MISSING)
            if inspect.isfunction(attr) and depth < 2:  # self._init_model(...): the class it returns
                try:
                    tree = source_scan.parse_function(inspect.getsource(attr))
                except (OSError, TypeError):
                    return _MISSING
                for node in ast.walk(tree) if tree is not None else ():
                    if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                        v = _resolve_name(node.value.func, _local_env(tree, attr.__globals__),
                                          dict(inspect.signature(attr).parameters), {}, cls, depth + 1)
                        if isinstance(v, type):
                            return v
                return _MISSING
            return attr
        base = _resolve_name(expr.value, env, params, overrides, cls, depth)
        return getattr(base, expr.attr, _MISSING) if base is not _MISSING else _MISSING
    return _MISSING


def _local_env(tree: ast.AST, globs: dict) -> dict:
    """The function's globals plus what it imports locally (``from sglang.srt.models.llama4 import X``)."""
    env = dict(globs)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            try:
                mod = importlib.import_module(node.module)
            except ImportError:
                continue
            for a in node.names:
                env[a.asname or a.name] = getattr(mod, a.name, _MISSING)
    return env


def _is_init_call(node) -> bool:
    """``super().__init__(...)`` or ``Base.__init__(self, ...)``."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__"


def _eval_test(expr: ast.AST, resolve) -> Optional[bool]:
    """The truth of an ``if`` test in an ``__init__`` where it only compares names (``language_model_cls is
    Qwen3LLMModel``); None when it depends on anything else."""
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1 and isinstance(expr.ops[0], (ast.Is, ast.IsNot, ast.Eq,
                                                                                           ast.NotEq)):
        a, b = resolve(expr.left), resolve(expr.comparators[0])
        if a is _MISSING or b is _MISSING:
            return None
        same = a is b if isinstance(expr.ops[0], (ast.Is, ast.IsNot)) else a == b
        return same if isinstance(expr.ops[0], (ast.Is, ast.Eq)) else not same
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        v = _eval_test(expr.operand, resolve)
        return None if v is None else not v
    return None


@functools.lru_cache(maxsize=None)
def init_facts(cls: type) -> Dict[str, Any]:
    """What ``cls.__init__`` (through its bases, following what each ``super().__init__`` call passes, positional
    arguments too) assigns to ``self.model`` / ``self.language_model`` / ``self.llm`` (the sub-model's class and the
    config expression it is built from) and to ``self.config`` (an expression of the ``config`` argument), read
    from the source. Under an ``if`` whose test compares names only, just the branch that runs counts; under any
    other test both branches count and, for ``self.config``, the last assignment in source order wins."""
    out: Dict[str, Any] = {}
    bindings: Dict[str, Any] = {}   # parameter name -> value, as the derived class's super().__init__ passes it
    pending_args: Optional[Tuple[list, list]] = None
    for k in cls.__mro__:
        init = k.__dict__.get("__init__")
        if not inspect.isfunction(init):
            continue
        try:
            tree = source_scan.parse_function(inspect.getsource(init))
            sig = inspect.signature(init)
        except (OSError, TypeError, ValueError):
            continue
        if tree is None:
            continue
        params = dict(sig.parameters)
        names = [n for n in params if n != "self"]
        local = dict(bindings)
        if pending_args is not None:  # what the derived class passed, by position and by name
            args, kws = pending_args
            for n, v in zip(names, args):
                local.setdefault(n, v)
            for n, v in kws:
                local.setdefault(n, v)
        env = _local_env(tree, init.__globals__)

        def resolve(e, _env=env, _params=params, _local=local):
            if isinstance(e, ast.Constant):
                return e.value
            return _resolve_name(e, _env, _params, _local, cls)

        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        calls = [n for n in ast.walk(tree) if _is_init_call(n)]
        decided = set(out)
        for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
            t = node.targets[0] if len(node.targets) == 1 else None
            if not (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"):
                continue
            if t.attr not in CHILD_ATTRS + ("config",) or t.attr in decided:
                continue
            ok, p = True, parents.get(node)
            while p is not None and ok:
                if isinstance(p, ast.If):
                    branch = node_in(p.body, node)
                    v = _eval_test(p.test, resolve)
                    ok = v is None or v == branch
                p = parents.get(p)
            if not ok:
                continue
            if t.attr == "config":
                out["config"] = ast.unparse(node.value)  # the last taken assignment wins (source order)
            elif isinstance(node.value, ast.Call):
                v = resolve(node.value.func)
                if isinstance(v, type):
                    cfg = next((kw.value for kw in node.value.keywords if kw.arg == "config"),
                               node.value.args[0] if node.value.args else None)
                    out[t.attr] = (v, ast.unparse(cfg) if cfg is not None else None)
                    decided.add(t.attr)
        if calls:
            c = calls[0]
            args = [resolve(a) for a in c.args if not (isinstance(a, ast.Name) and a.id == "self")]
            pending_args = (args, [(kw.arg, resolve(kw.value)) for kw in c.keywords if kw.arg])
            bindings = {n: v for n, v in local.items()}
        else:
            break
    return out


def node_in(body, node) -> bool:
    """Whether ``node`` sits in the statements ``body`` (the if-branch) rather than in the else-branch."""
    return any(node is n or any(node is m for m in ast.walk(n)) for n in body)


def child_classes(cls: type) -> Dict[str, Tuple[Optional[type], Optional[str]]]:
    """The classes ``cls.__init__`` assigns to ``self.model`` / ``self.language_model`` / ``self.llm``."""
    return {k: v for k, v in init_facts(cls).items() if k in CHILD_ATTRS}


def _child_config(expr: Optional[str], config):
    """The config a child is built from: ``config``, ``config.text_config``, ``config.get_text_config()``..."""
    if not expr or expr == "config":
        return config
    node = source_scan.parse_function(expr)
    try:
        e = node.body[0].value
        steps = []
        while True:
            if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and not e.args:
                steps.append(("call", e.func.attr))
                e = e.func.value
            elif isinstance(e, ast.Attribute):
                steps.append(("attr", e.attr))
                e = e.value
            else:
                break
        if not (isinstance(e, ast.Name) and e.id == "config"):
            raise ValueError(expr)
        v = config
        for kind, name in reversed(steps):
            v = getattr(v, name)() if kind == "call" else getattr(v, name)
        return v
    except Exception:  # a local variable (text_config = ...): the text config is the usual meaning
        if "text" in expr and hasattr(config, "get_text_config"):
            return config.get_text_config()
        return config


class StandIn:
    """Stands in for an SGLang model object while one of its methods runs: attribute reads come from the
    class (bound to the stand-in), ``config``/``pp_group``/``layers`` and the sub-model children are
    provided, and every attribute the method sets is recorded."""

    def __init__(self, cls: Optional[type], config, num_layers: int, last_rank: bool = True, name: str = "self",
                 trace: Optional[list] = None):
        d = {"cls": cls, "config": config, "L": num_layers, "set": {}, "children": {}, "name": name,
             "trace": trace if trace is not None else [],
             "pp": types.SimpleNamespace(is_last_rank=last_rank, is_first_rank=True, world_size=1, rank_in_group=0),
             "layers": None, "last": last_rank}
        object.__setattr__(self, "_d", d)

    def __getattr__(self, name):
        d = object.__getattribute__(self, "_d")
        if name in d["set"]:
            return d["set"][name]
        if name == "config":
            expr = init_facts(d["cls"]).get("config") if d["cls"] is not None else None
            return _child_config(expr, d["config"]) if expr else d["config"]
        if name == "pp_group":
            return d["pp"]
        if name == "layers":
            if d["layers"] is None:
                d["layers"] = [types.SimpleNamespace() for _ in range(d["L"])]
            return d["layers"]
        if name in CHILD_ATTRS and d["cls"] is not None:
            if name not in d["children"]:
                spec = child_classes(d["cls"]).get(name)
                if spec is None:
                    raise AttributeError(name)
                ccls, cfg_expr = spec
                d["children"][name] = StandIn(ccls, _child_config(cfg_expr, d["config"]), d["L"], d["last"],
                                              f"{d['name']}.{name}", d["trace"])
            return d["children"][name]
        cls = d["cls"]
        attr = inspect.getattr_static(cls, name, _MISSING) if cls is not None else _MISSING
        if attr is _MISSING:
            raise AttributeError(name)
        if isinstance(attr, staticmethod):
            return attr.__func__
        if isinstance(attr, classmethod):
            return attr.__get__(None, cls)
        if isinstance(attr, property):
            return attr.fget(self)
        if inspect.isfunction(attr):
            if attr.__name__.startswith("set_eagle3"):
                d["trace"].append((attr.__module__, attr.__qualname__))
            return types.MethodType(attr, self)
        return attr

    def __setattr__(self, name, value):
        object.__getattribute__(self, "_d")["set"][name] = value

    # ------------------------------------------------------------------ what the method did
    def walk(self):
        """This stand-in, then every sub-model child it created, depth first."""
        d = object.__getattribute__(self, "_d")
        yield self
        for c in d["children"].values():
            yield from c.walk()

    @property
    def info(self) -> dict:
        """The stand-in's own record: its class, config, layer count, the children it created and every attribute the
        method set (``set``), and the trace of ``set_eagle3*`` methods run."""
        return object.__getattribute__(self, "_d")


@contextlib.contextmanager
def _pp_group_stand_in(last_rank: bool):
    """Some classes read the pipeline group from SGLang's runtime context (``get_parallel().pp_group``)."""
    from sglang.srt.runtime_context import get_parallel

    pp = types.SimpleNamespace(is_last_rank=last_rank, is_first_rank=True, world_size=1, rank_in_group=0)
    try:
        cm = get_parallel().override(pp_group=pp)
    except Exception:  # pragma: no cover - a runtime context that refuses a stand-in
        cm = contextlib.nullcontext()
    with cm:
        yield


@contextlib.contextmanager
def _probing(last_rank: bool = True):
    with quiet_sglang(), _pp_group_stand_in(last_rank):
        yield


def probe(cls: type, config, ids: Optional[List[int]], num_layers: int, last_rank: bool = True,
          _entered: bool = False) -> dict:
    """Run ``cls.set_eagle3_layers_to_capture(ids)`` on a stand-in. Returns ``{"layers_to_capture": list or
    None, "flags": [layer indices flagged], "capturing": stand-in that holds the list, "error": "Type: msg" or
    None, "capture_aux": bool}``."""
    top = StandIn(cls, config, num_layers, last_rank)
    err = None
    fn = inspect.getattr_static(cls, "set_eagle3_layers_to_capture", None)
    top.info["trace"].append((fn.__module__, fn.__qualname__))
    with (contextlib.nullcontext() if _entered else _probing(last_rank)):
        try:
            fn(top, None if ids is None else list(ids))
        except Exception as e:  # what SGLang itself would raise at start-up
            err = f"{type(e).__name__}: {e}"
    holder, ltc = None, None
    for s in top.walk():
        if "layers_to_capture" in s.info["set"]:
            holder, ltc = s, list(s.info["set"]["layers_to_capture"])
    flags = []
    if holder is not None and holder.info["layers"] is not None:
        flags = [i for i, lay in enumerate(holder.info["layers"]) if getattr(lay, "_is_layer_to_capture", False)]
    return {"layers_to_capture": ltc, "flags": flags, "capturing": holder, "error": err,
            "capture_aux": bool(top.info["set"].get("capture_aux_hidden_states")),
            "ran": " -> ".join(dict.fromkeys(q for _, q in top.info["trace"])),
            "ran_modules": list(dict.fromkeys(m for m, _ in top.info["trace"]))}


# ------------------------------------------------------------------------------ rule classification
def _rule_plus_one(ids, L):
    return [i + 1 for i in ids]


def _rule_first_one(ids, L):
    return [i + 1 for i in ids] if ids and ids[0] == 1 else list(ids)


def _rule_max_l(ids, L):
    return list(ids) if ids and max(ids) == L else [i + 1 for i in ids]


def _rule_identity(ids, L):
    return list(ids)


# The id -> boundary rules the doctor can name; which one a class follows is learned by probing it.
ID_RULES = {
    "id+1": (_rule_plus_one, "id + 1"),
    "id+1-if-first-is-1": (_rule_first_one, "id + 1 if the first id is 1, else id"),
    "id-if-max-is-L": (_rule_max_l, "id if the largest id is L, else id + 1"),
    "id": (_rule_identity, "id"),
}

PROBE_IDS = ([1, 15, 28], [2, 16, 29], [0, 5, 9], [3, 10, 20], [-1, 3, 9], [1, 29, 30], [2, 30, 31],
             [1, 17, 35], [24, 30, 36], [9, 1, 5], [1, 1, 20])
PROBE_LAYERS = (32, 36, 61)


def _fit_default(lists: Dict[int, List[int]]) -> Optional[List[str]]:
    """Default boundaries as formulas of L (``"2"``, ``"L//2"``, ``"L-3"``) fitted to probes at several L."""
    Ls = sorted(lists)
    if not Ls or len({len(v) for v in lists.values()}) != 1:
        return None
    out = []
    for k in range(len(lists[Ls[0]])):
        vals = {L: lists[L][k] for L in Ls}
        for name, f in (("", lambda L: 0), ("L//2", lambda L: L // 2), ("L", lambda L: L)):
            cs = {v - f(L) for L, v in vals.items()}
            if len(cs) == 1:
                c = cs.pop()
                out.append(str(c) if not name else (name if c == 0 else f"{name}{c:+d}"))
                break
        else:
            return None
    return out


def eval_default(formulas: List[str], L: int) -> List[int]:
    """Default boundary formulas (``"2"``, ``"L//2"``, ``"L-3"``: a constant, or ``L`` / ``L//2`` plus an offset)
    evaluated for ``L`` layers."""
    out = []
    for f in formulas:
        base, rest = (L // 2, f[4:]) if f.startswith("L//2") else ((L, f[1:]) if f.startswith("L") else (0, f))
        out.append(base + (int(rest) if rest else 0))
    return out


def classify(cls: type) -> dict:
    """Probe ``cls.set_eagle3_layers_to_capture`` over :data:`PROBE_IDS` x :data:`PROBE_LAYERS` (a recording
    config) and name the rule it follows."""
    results, errors, defaults, reads = [], [], {}, []
    with _probing(True):
        for L in PROBE_LAYERS:
            r = probe(cls, RecordingConfig(L, reads=reads), None, L, _entered=True)
            if r["error"] is None and r["layers_to_capture"] is not None:
                defaults[L] = r["layers_to_capture"]
            for ids in PROBE_IDS:
                r = probe(cls, RecordingConfig(L, reads=reads), ids, L, _entered=True)
                if r["error"]:
                    errors.append((ids, L, r["error"]))
                elif r["layers_to_capture"] is not None:
                    results.append((ids, L, r["layers_to_capture"]))
        r32 = probe(cls, RecordingConfig(32), [1, 15, 28], 32, _entered=True)
        over = probe(cls, RecordingConfig(32), [1, 15, 31], 32, _entered=True)
    rule = next((k for k, (f, _) in ID_RULES.items() if results and all(f(i, L) == b for i, L, b in results)), None)
    gate = probe(cls, RecordingConfig(32), [1, 15, 28], 32, last_rank=False)
    holder = r32["capturing"]
    out = {
        "id_rule": rule,
        "default": _fit_default(defaults),
        "num_layers_read": sorted(set(reads)),
        "pp_last_rank_only": gate["layers_to_capture"] is None and not gate["error"],
        "holder": holder.info["name"] if holder is not None else None,
        "holder_class": _qualname(holder.info["cls"]) if holder is not None and holder.info["cls"] else None,
        "uses_layer_flags": bool(r32["flags"]),
        "ran": r32["ran"],
        "ran_modules": r32["ran_modules"],
        "probe_errors": sorted({e.split(":")[0] for _, _, e in errors}),
    }
    # ids naming boundary L: models that flag self.layers[b] raise IndexError at start-up
    out["boundary_L_error"] = over["error"]
    return out


def _qualname(c: type) -> str:
    return f"{c.__module__}.{c.__qualname__}"


def _sources_of(cls: Optional[type]) -> List[str]:
    """Sources of every function ``cls`` defines or inherits from SGLang classes (the layer loop may live in
    a helper of ``forward``)."""
    if cls is None:
        return []
    out = []
    for k in cls.__mro__:
        if not k.__module__.startswith("sglang."):
            continue
        for v in k.__dict__.values():
            if inspect.isfunction(v):
                try:
                    out.append(inspect.getsource(v))
                except (OSError, TypeError):
                    pass
    return out


@functools.lru_cache(maxsize=None)
def capture_code(holder_cls: Optional[type]) -> dict:
    """Where the capturing model takes its captures, read from its source."""
    sites = source_scan.capture_sites(_sources_of(holder_cls))
    entry = [s for s in sites if s["where"] == "entry"]
    final = [s for s in sites if s["where"] in ("final-norm", "after-loop")]
    scaled = None
    if holder_cls is not None:
        try:
            scaled = source_scan.scaled_embedding(inspect.getsource(holder_cls))
        except (OSError, TypeError):
            scaled = None
    return {
        "entry": entry[0]["value"] if entry else None,
        "entry_code": entry[0]["code"] if entry else None,
        "final": (final[0]["where"] if final else None),
        "final_value": final[0]["value"] if final else None,
        "final_code": final[0]["code"] if final else None,
        "scaled_embedding": scaled,
    }


def describe_class(arch: str, cls: Optional[type]) -> dict:
    """One table row: what SGLang's own code says about serving EAGLE-3 for this target class."""
    if cls is None:
        return {"supported": False, "class": arch, "reason": "no SGLang model class"}
    fn = getattr(cls, "set_eagle3_layers_to_capture", None)
    row: Dict[str, Any] = {"class": _qualname(cls)}
    if fn is None:
        dispatch = next((k for k in cls.__mro__ if "__getattr__" in k.__dict__ and k.__module__.startswith("sglang.")),
                        None)
        if dispatch is not None and "def set_eagle3_layers_to_capture" in _module_source(cls):
            row.update(supported=None, reason=f"{cls.__name__} forwards attribute lookups ({dispatch.__name__}."
                                              f"__getattr__) to an object chosen at start-up")
            return row
        row.update(supported=False, reason=(f"{cls.__name__} has no set_eagle3_layers_to_capture: SGLang raises "
                                            f"'Model {cls.__name__} does not implement set_eagle3_layers_to_capture' "
                                            f"at start-up (attention_backend_setup."
                                            f"configure_aux_hidden_state_capture)"))
        return row
    row["supported"] = True
    row["ids_method"] = fn.__qualname__
    row.update(classify(cls))
    holder_cls = _resolve_qualname(row["holder_class"]) if row["holder_class"] else None
    row["capture"] = capture_code(holder_cls)
    return row


def _module_source(cls: type) -> str:
    try:
        return inspect.getsource(inspect.getmodule(cls))
    except (OSError, TypeError):
        return ""


def _resolve_qualname(q: str) -> Optional[type]:
    parts = q.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p, None)
        return obj if isinstance(obj, type) else None
    return None


# ----------------------------------------------------------------------------------------- draft heads
@functools.lru_cache(maxsize=None)
def _source_index():
    """SGLang's installed sources read with ast (source_reader.py; vLLM's wheel is read with it too), for the heads'
    layers."""
    import sglang
    from pathlib import Path

    return source_reader.Index(source_reader.SourceTree(Path(sglang.__file__).resolve().parent.parent))


@functools.lru_cache(maxsize=None)
def head_layer(cls: type) -> dict:
    """The checkpoint tensors the head's ``load_weights`` loads into its decoder layer: its ``__init__`` chain and
    name mapping read from SGLang's source (:func:`.source_reader.head_layer`); no model is built (SGLang's layers
    need its runtime context and a device)."""
    return source_reader.head_layer(_source_index(), cls.__module__.replace(".", "/") + ".py", cls.__name__)


def draft_head(cls: type) -> Optional[dict]:
    """The class is an EAGLE-3 head when its module reads the target's captures (``spec_info.hidden_states``)
    and sizes its ``fc`` by ``num_aux_hidden_states``; also how it treats ``tie_word_embeddings``."""
    src = _module_source(cls)
    if "spec_info.hidden_states" not in src or "num_aux_hidden_states" not in src:
        return None
    try:
        own = inspect.getsource(cls)
    except (OSError, TypeError):
        own = ""
    tied = next((ln.strip() for ln in own.splitlines() if "self.lm_head = self.model.embed_tokens" in ln), None)
    set_embed = getattr(cls, "set_embed", None)
    replaces = False
    if set_embed is not None:
        try:
            replaces = "embed_tokens.weight = embed" in inspect.getsource(set_embed)
        except (OSError, TypeError):
            replaces = False
    return {"class": _qualname(cls), "tied_lm_head": tied,
            "set_embed": _qualname(set_embed) if set_embed is not None and replaces else None,
            "scaled_embedding": source_scan.scaled_embedding(src), "layer": head_layer(cls),
            "untied_lm_head": untied_lm_head(own)}


@functools.lru_cache(maxsize=None)
def worker_lm_head() -> Optional[str]:
    """The EAGLE-3 worker function that gives a draft whose ``load_lm_head_from_target`` is set the target's
    embedding and head (``set_embed_and_head``) and any other draft the embedding only (``set_embed``), read from
    its source; None when the installed worker does not read that flag so."""
    try:
        from sglang.srt.speculative import eagle_worker_v2 as w

        fn = w.EagleDraftWorker.init_lm_head
        src = inspect.getsource(fn)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    if "load_lm_head_from_target" in src and "set_embed_and_head(embed, head)" in src and "set_embed(embed)" in src:
        return _qualname(fn)
    return None


def untied_lm_head(init_source: str) -> Optional[dict]:
    """What an untied head builds for its lm_head, read from its source: ``shares_when`` = the test under which it
    sets ``load_lm_head_from_target`` (and SGLang's EAGLE-3 worker then gives it the target's head:
    eagle_worker_v2.init_lm_head calls set_embed_and_head; otherwise set_embed only, and the head keeps what it
    loaded, or nothing); ``reads_draft_vocab_size``: ``attribute`` (config.draft_vocab_size: a config without the
    key raises AttributeError at start-up) or ``getattr`` (absent = None). tests/doctor/test_engine_tables.py builds
    each head on the CPU to hold this to what the class does."""
    lines = [ln.strip() for ln in init_source.splitlines()]
    at = next((i for i, ln in enumerate(lines) if ln.startswith("self.load_lm_head_from_target = True")), None)
    if at is None or at == 0 or not lines[at - 1].startswith("if "):
        return None
    test = lines[at - 1]
    if not re.fullmatch(r"if (config\.)?draft_vocab_size is None:", test):
        return {"shares_when": test, "reads_draft_vocab_size": None}  # a rule the doctor does not know: said
    reads = "getattr" if re.search(r"getattr\(config, [\"']draft_vocab_size[\"']", init_source) else "attribute"
    return {"shares_when": "draft_vocab_size is None", "reads_draft_vocab_size": reads, "worker": worker_lm_head()}


def sglang_table() -> dict:
    """The whole table for the installed SGLang: every registered class as the doctor reads it at run time
    (:func:`describe_class`), its EAGLE-3 heads, and the probes behind the id rules. The pinned table
    (``python -m tools.engine_tables sglang``) and the one the doctor keeps per installed SGLang
    (:mod:`.engine_cache`) are this."""
    reg = registry()
    rows = {arch: describe_class(arch, cls) for arch, cls in sorted(reg.items())}
    heads = {arch: h for arch, cls in sorted(reg.items()) if (h := draft_head(cls)) is not None}
    return {"engine": "sglang", "version": installed_version(), "targets": rows, "draft_heads": heads,
            "probes": {"ids": [list(i) for i in PROBE_IDS], "num_layers": list(PROBE_LAYERS)},
            "draft_head_rule": "a registered class whose module reads spec_info.hidden_states and sizes its fc by "
                               "num_aux_hidden_states"}
