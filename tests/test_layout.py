"""The package's structure, as a new maintainer relies on it: imports flow one way (no circle, counting
imports inside functions), product code never imports test code, and maintainer tools live outside the
package. Read from the source with ``ast`` (nothing is imported)."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "eagle3_ops"
TEST_MODULES = ({p.stem for p in (ROOT / "tests").rglob("*.py")}
                | {"tests", "benchmarks", "tools", "pytest", "hypothesis"})


def _modules() -> dict:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _imports(name: str, path: Path, mods: dict):
    """(imported module names, every node) of ``name``, relative imports resolved, ``from a import b``
    counted as ``a.b`` where that is a module."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for a in node.names:
                full = f"{module}.{a.name}"
                out.append((full if full in mods else module, node.lineno))
    return out


def _graph() -> dict:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        graph[name] = {m for m, _ in _imports(name, path, mods) if m in mods and m != name}
    return graph


def _cycles(graph: dict) -> list:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package_counting_imports_inside_functions():
    graph = _graph()
    # importing a submodule imports its package first: the package's __init__ must not import back
    # into what imports it (counted through the edges __init__ has, like any module's)
    cycles = _cycles(graph)
    assert not cycles, "import circles (module or function level): " + "; ".join(
        " <-> ".join(c) + " [" + ", ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) + "]" for c in cycles)


def test_the_checker_finds_a_circle():
    """The check above can fail: a two-module circle through a function-level import is found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycles(graph) == [["a", "b"]]
    assert not _cycles({"a": {"b"}, "b": set()})


def test_the_op_layer_flows_one_way():
    """registry -> dispatch -> ops: the registry and the self-checks import none of dispatch/ops."""
    graph = _graph()
    for leaf in ("eagle3_ops.registry", "eagle3_ops.verify", "eagle3_ops.problems", "eagle3_ops.validation"):
        assert not graph[leaf] & {"eagle3_ops.dispatch", "eagle3_ops.ops", "eagle3_ops"}, (leaf, graph[leaf])
    assert "eagle3_ops.ops" not in graph["eagle3_ops.dispatch"]


def test_no_product_module_imports_test_code_or_tools():
    mods = _modules()
    bad = []
    for name, path in mods.items():
        for module, line in _imports(name, path, mods):
            if module.split(".")[0] in TEST_MODULES:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, bad


@pytest.mark.parametrize("tool", ["sass", "vllm_code", "vllm_tables", "generate", "engine_tables", "readme",
                                  "doctor_rule_table"])
def test_maintainer_tools_live_outside_the_package(tool):
    assert not [p for p in PACKAGE.rglob(f"{tool}.py")], f"{tool}.py is a maintainer tool: tools/, not eagle3_ops/"


def test_the_readme_is_a_front_door():
    """At most 300 lines, the two commands on the first screen, and every relative link resolves (the
    depth lives in docs/)."""
    import re

    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; depth goes into docs/"
    first = "\n".join(lines[:40])
    assert "make demo" in first and "make test" in first, "make demo / make test must be in README's first 40 lines"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", "\n".join(lines)):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def _package_modules():
    for path in sorted((ROOT / "eagle3_ops").rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_no_module_imports_another_modules_private_names():
    """One way through the code: a name with a leading underscore stays in its module (a private module, such
    as ``_cli``, may be imported: its file is the package-internal unit)."""
    bad = []
    for path, tree in _package_modules():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.module == "__future__":
                continue
            if not (node.level or (node.module or "").startswith("eagle3_ops")):
                continue
            base = path.parent
            for _ in range(max(node.level - 1, 0)):
                base = base.parent
            if not node.level:
                base = ROOT
            package = base.joinpath(*(node.module or "").split(".")) if node.module else base
            for alias in node.names:
                is_module = (package / f"{alias.name}.py").exists() or (package / alias.name).is_dir()
                if alias.name.startswith("_") and not alias.name.startswith("__") and not is_module:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {alias.name} from "
                               f"{'.' * node.level}{node.module or ''}")
    assert not bad, "\n".join(bad)


def test_every_public_function_and_class_has_a_docstring():
    """What it takes and returns and why it exists, in a few lines: every public module-level function and class
    of the package, and every public method of a module-level class, says it."""
    missing = []
    for path, tree in _package_modules():
        nodes = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                nodes.append(node)
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    nodes += [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        missing += [f"{path.relative_to(ROOT)}:{n.lineno}: {n.name}" for n in nodes
                    if not n.name.startswith("_") and ast.get_docstring(n) is None]
    assert not missing, "no docstring:\n" + "\n".join(missing)
