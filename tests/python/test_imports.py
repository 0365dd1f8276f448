"""The package's modules import one another in one direction: the graph of their imports of
each other (at the top of a module or inside a function; imports only for type checking
excepted) has no cycle, no module takes a name from the package root (``from .. import
NAME``: the root's ``__init__`` imports them), every module imports alone (in a process of its
own, without the package's ``__init__``), and a subpackage's private modules are imported from
inside it (the one exception: ``ferry._sim`` takes the plan format's types from
``ferry._plan._format``, not the plan application)."""

import ast
import importlib.util
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


def _extension(module):
    """Whether ``module`` (a submodule of the package, with no source here) is a compiled
    module: `from . import X` of anything else takes the name X from the package itself."""
    return importlib.util.find_spec(module) is not None


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
            elif node.module is not None or not _extension(sub):  # a name of `target`
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
    assert {"ferry._offload", "ferry._checkpoint", "ferry._names"} <= set(graph)
    assert {"ferry._plan", "ferry._plan._format", "ferry._plan._run"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_finds_a_planted_cycle():
    graph = import_graph()
    graph["ferry._checkpoint"] = graph["ferry._checkpoint"] | {"ferry._offload"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]


def root_imports(graph):
    """The modules in ``graph`` below the package root that import the root itself."""
    return sorted(name for name, targets in graph.items() if name != "ferry" and "ferry" in targets)


def test_no_module_takes_a_name_from_the_package_root():
    assert root_imports(import_graph()) == []


def test_a_name_taken_from_the_package_root_is_an_import_of_the_root(tmp_path):
    modules = {"ferry": None}
    planted = tmp_path / "planted.py"
    planted.write_text("def version():\n    from .. import __version__\n\n    return __version__\n")
    assert _imports(str(planted), "ferry._cli.planted", modules) == {"ferry"}
    # A compiled module of the package is no name of its __init__.
    planted.write_text("from .. import _C\n")
    assert _imports(str(planted), "ferry._cli.planted", modules) == set()
    graph = import_graph()
    graph["ferry._cli.main"] = graph["ferry._cli.main"] | {"ferry"}
    assert root_imports(graph) == ["ferry._cli.main"]


# What a module's imports may use of a subpackage it is not in: the subpackage itself (its
# __init__), and these private modules.
SHARED_PRIVATE = {"ferry._plan._format"}


def _private_to(module):
    """The subpackage whose private module ``module`` is, or None."""
    package, _, last = module.rpartition(".")
    return package if package != "ferry" and last.startswith("_") else None


def outside_imports(graph):
    """The imports in ``graph`` of a subpackage's private module from outside the subpackage,
    as "A imports B" strings."""
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        for target in targets
        if (package := _private_to(target)) is not None
        and not (name == package or name.startswith(package + "."))
        and target not in SHARED_PRIVATE
    )


def test_a_subpackages_private_modules_are_imported_from_inside_it():
    graph = import_graph()
    assert outside_imports(graph) == []
    # The op-naming rule is one module that the trace and the plan run both import.
    assert "ferry._names" in graph["ferry._trace._record"]
    assert "ferry._names" in graph["ferry._plan._run"]
    graph["ferry._plan._run"] = graph["ferry._plan._run"] | {"ferry._trace._record"}
    assert outside_imports(graph) == ["ferry._plan._run imports ferry._trace._record"]


# Imports each module named in `sys.argv[1:]` in a process of its own, forked from one that has
# imported torch and nothing of ferry, with `ferry/__init__.py` left out: a bare package stands
# in for it, so the module loads only what it imports itself, in its own order. (Torch comes
# first, as in the package's __init__, for ferry._C; forking spares each module its import.)
_ALONE = """
import importlib, importlib.util, os, sys, traceback
import torch
spec = importlib.util.find_spec("ferry")
failed = []
for module in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            sys.modules["ferry"] = importlib.util.module_from_spec(spec)
            importlib.import_module(module)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitpid(pid, 0)[1] != 0:
        failed.append(module)
print(" ".join(failed))
"""


def test_each_module_imports_alone():
    modules = sorted(set(import_graph()) - {"ferry"})
    assert importlib.util.find_spec("ferry").submodule_search_locations == [PACKAGE]
    done = subprocess.run(
        [sys.executable, "-c", _ALONE, *modules], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == [], done.stderr[-4000:]
