"""The house's standing limits, read from the source: no import cycle among the repository's own modules (an import
inside a function counts: one placed there to dodge a cycle is still a cycle), no function over 80 lines, at most 16
Python files at the root, the files of the replica groups, the trainer's checkpoint and zero at most 500 lines each, and a
README whose map cells stay at 300 characters. Each check is a pure read of the files: no import, no process."""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's root (this file: tests/)
MAX_FUNCTION_LINES = 80
MAX_ROOT_FILES = 16
MAX_ROOM_LINES = 500
ROOMS = ("replicas", os.path.join("trainer", "checkpoint"), "zero", os.path.join("zero", "offload"),
         os.path.join("zero", "checkpoint"))  # the packages whose files keep to MAX_ROOM_LINES
MAX_MAP_CELL = 300


def sources(root: str = ROOT) -> dict[str, str]:
    """Module name -> path, for every .py file of the repository (a package's __init__.py under the package's name)."""
    found = {}
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        parts = os.path.relpath(path, root)[:-3].split(os.sep)
        if parts[0].startswith("."):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def lazy_exports(tree: ast.Module, package: str) -> set[str]:
    """The modules a package's ``__getattr__`` imports at first use (zero/__init__.py's EXPORTS and SUBMODULES): an
    edge as real as an import statement, only later."""
    named = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("EXPORTS", "SUBMODULES")
                                                for t in node.targets):
            value = ast.literal_eval(node.value)
            named |= set(value.values()) if isinstance(value, dict) else {f"{package}.{name}" for name in value}
    return named


def imports_of(name: str, path: str, modules: set[str]) -> set[str]:
    """The repository modules ``name`` imports, anywhere in the file (function bodies included). ``from P import X``
    is an edge to P.X when that is a module, else to P; a parent package is not an edge of its own."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    edges = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            edges |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                base = ".".join(anchor + ([base] if base else []))
            edges |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    edges |= lazy_exports(tree, name)
    return {edge for edge in edges if edge in modules and edge != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1
        stack.append(start); on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop(); on_stack.discard(member); component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]; counter[0] += 1
                stack.append(child); on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    modules = sources(root)
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def long_functions(root: str = ROOT) -> list[str]:
    """Every function (a method, a nested one) over MAX_FUNCTION_LINES, decorators not counted."""
    found = []
    for path in sources(root).values():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{os.path.relpath(path, root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_function_level_imports(tmp_path):
    # a.py imports b at its top, b.py imports a inside a function: a cycle all the same
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n    return g\n")
    (tmp_path / "c.py").write_text("import a\n")
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from p.x import y\n")
    (pkg / "x.py").write_text("from . import z\ny = 1\n")
    (pkg / "z.py").write_text("import c\n")
    assert cycles(import_graph(str(tmp_path))) == [["a", "b"]]
    (tmp_path / "c.py").write_text("import p\n")
    (tmp_path / "b.py").write_text("import p.x\n")
    (pkg / "z.py").write_text("def f():\n    import a\n")
    assert cycles(import_graph(str(tmp_path))) == [["a", "b", "p.x", "p.z"]]


def test_no_function_over_the_limit():
    assert long_functions() == []


def test_the_root_and_the_rooms_keep_their_size():
    root_files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert len(root_files) <= MAX_ROOT_FILES, root_files
    for room in ROOMS:
        paths = glob.glob(os.path.join(ROOT, room, "*.py"))
        assert paths, f"{room}/ holds no Python file"
        for path in paths:
            assert len(open(path).read().splitlines()) <= MAX_ROOM_LINES, path


def test_the_readme_map_cells_are_short():
    text = open(os.path.join(ROOT, "README.md")).read()
    table = text[text.index("| where | what it holds |"):]
    rows = re.findall(r"^\| (.+?) \| (.+) \|$", table[:table.index("\n\n")], re.M)[2:]
    assert rows
    for where, what in rows:
        assert len(what) <= MAX_MAP_CELL, where
