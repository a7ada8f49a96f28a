"""The package's imports run one way: commands / pipelines -> server -> runtime, scheduler -> engine, loading,
generation -> exporters -> stamp, artifacts, cache, hub -> backends -> modeling -> configuration, with no cycles,
as docs/architecture.md's table of layers says. Function-level imports count too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "optimum_neuronx"

# Lowest first; a module may import modules of its own layer or of a lower one. Names are module paths relative to
# the package; a package name covers everything in it.
LAYERS = [
    ("version", "instances", "configuration", "digests", "tempdirs"),
    ("modeling",),
    ("memory", "huge_pages", "buckets"),
    ("backends",),
    ("stamp", "artifacts", "weights_io", "trust", "cache", "hub"),
    ("exporters",),
    ("kv_cache", "engine", "loading", "generation"),
    ("scheduler", "runtime", "verification", "utils"),
    ("server",),
    ("pipelines", "commands", "serve", "__init__"),
]


def test_the_layers_are_those_docs_architecture_lists():
    import re

    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and "`" in line]
    documented = [tuple(name.removesuffix("/").removesuffix(".py") for name in re.findall(r"`([^`]+)`", row))
                  for row in rows]
    assert [set(names) for names in reversed(documented)] == [set(names) for names in LAYERS]


def _modules() -> dict[str, Path]:
    return {".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__") or "__init__": path
            for path in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int:
    for rank, names in enumerate(LAYERS):
        if any(module == name or module.startswith(name + ".") for name in names):
            return rank
    raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def _imports(module: str, path: Path) -> set[str]:
    """The package's modules that `module` imports (relative and absolute, at any depth of the file)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    if module == "__init__":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("optimum_neuronx"):
                target = node.module.removeprefix("optimum_neuronx").lstrip(".")
            else:
                continue
            found.add(target or "__init__")
            # `from package import module` imports that module too
            found.update(name for alias in node.names if (name := f"{target}.{alias.name}".lstrip(".")) in _MODULES)
        elif isinstance(node, ast.Import):
            found.update(alias.name.removeprefix("optimum_neuronx").lstrip(".") or "__init__"
                         for alias in node.names if alias.name.startswith("optimum_neuronx"))
    return {name for name in found if name != module}


_MODULES = _modules()


def test_every_import_points_down_the_layers():
    wrong = [f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})"
             for module, path in _MODULES.items() for target in _imports(module, path)
             if _layer(target) > _layer(module)]
    assert not wrong, "\n".join(wrong)


def test_configuration_imports_only_plain_data():
    assert _imports("configuration", _MODULES["configuration"]) <= {"instances"}
    assert _imports("instances", _MODULES["instances"]) == set()


def test_modeling_knows_no_backend():
    for module, path in _MODULES.items():
        if module.startswith("modeling"):
            assert not {t for t in _imports(module, path) if not t.startswith("modeling")}, module
            assert "_inductor" not in path.read_text() and "mkldnn" not in path.read_text(), module


def test_no_import_cycles():
    graph = {module: {t if t in _MODULES else t.rsplit(".", 1)[0] for t in _imports(module, path)}
             for module, path in _MODULES.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of the code.
    graph = {m: {t for t in targets if not (m.count(".") < t.count(".") and t.startswith(m + "."))}
             for m, targets in graph.items()}
    state: dict[str, int] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for target in graph.get(module, ()):
            assert state.get(target) != 1, "import cycle: " + " -> ".join([*trail, module, target])
            if target not in state:
                visit(target, [*trail, module])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [])
