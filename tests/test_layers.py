"""The library's layers run one way (docs/concepts/architecture.md): nothing imports a layer above it, and
there is no import cycle between modules — counting imports inside functions too, so a cycle cannot
hide behind a function-local import. The Flower transport is one subpackage above the run layer."""

import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
# bottom to top; a module may import its own layer or any layer below
LAYERS = [
    ("fedkl.privacy", "fedkl.data"),
    ("fedkl.problems",),
    ("fedkl.federation",),
    ("fedkl.algorithms",),
    ("fedkl.runner", "fedkl.saved_model", "fedkl.results", "fedkl.tuning"),
    ("fedkl.flower",),
    ("fedkl.experiments", "fedkl.audit", "fedkl.cli", "fedkl.api", "fedkl"),
]


def _module(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, module
    return best[0]


def _imports(path: pathlib.Path, module: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = module.rsplit(".", node.level - (1 if path.name == "__init__.py" else 0))[0]
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module
            out.add(name)
            out |= {f"{name}.{a.name}" for a in node.names}
    return {m for m in out if m == "fedkl" or m.startswith("fedkl.")}


def _graph():
    modules = {_module(p): p for p in (ROOT / "fedkl").rglob("*.py")}
    g = nx.DiGraph()
    for mod, path in modules.items():
        g.add_node(mod)
        for imp in _imports(path, mod):
            while imp not in modules and "." in imp:  # `from fedkl.x import name`: the module is fedkl.x
                imp = imp.rsplit(".", 1)[0]
            if imp in modules and imp != mod and imp != "fedkl":
                g.add_edge(mod, imp)
    return g


def test_no_module_imports_a_layer_above_it():
    up = [(a, b) for a, b in _graph().edges if _layer(b) > _layer(a)]
    assert not up, up


def test_no_import_cycle():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, cycles[:5]
