"""The package's modules import one another in one direction: the graph of their imports of
each other (at the top of a module or inside a function; imports only for type checking
excepted) has no cycle, and the modules that once formed one import alone in a fresh
interpreter."""

import ast
import os
import subprocess
import sys

import ferry

PACKAGE = os.path.dirname(os.path.abspath(ferry.__file__))


def _module_name(path):
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[: -len(".py")].split(os.sep)
    if rel[-1] == "__init__":
        rel = rel[:-1]
    return ".".join(rel)


def _type_checking(node):
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path, name, modules):
    """The package modules the module at ``path`` (called ``name``) imports."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            skipped.update(id(n) for n in ast.walk(node))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped or not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = package.split(".")
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in modules:
                found.add(sub)
            elif node.module is not None:  # a name of the module `target`
                found.add(target)
            # else `from . import X` of a module with no source here (the extensions _C and
            # _simulator)
    return {m for m in found if m in modules and m != name}


def import_graph():
    paths = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                paths[_module_name(path)] = path
    return {name: _imports(path, name, paths) for name, path in paths.items()}


def find_cycle(graph):
    """A cycle of ``graph`` as a list of its modules, or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, stack)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert {"ferry._offload", "ferry._plan", "ferry._checkpoint"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_finds_a_planted_cycle():
    graph = import_graph()
    graph["ferry._checkpoint"] = graph["ferry._checkpoint"] | {"ferry._offload"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]


def test_the_modules_of_the_former_cycle_import_alone():
    for module in ("ferry._checkpoint", "ferry._plan", "ferry._offload", "ferry._regions"):
        done = subprocess.run(
            [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"import {module}: {done.stderr[-2000:]}"
