"""The package's floors: every import goes to the same floor or one below, and none goes round
in a circle (docs/architecture.md's Layout section, checked on every `import` in the package)."""

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_hybrid"

# floor of each module (a package's floor covers its modules unless one is named)
FLOORS = {
    "errors": 0, "quantized_tensor": 0, "native": 0, "timing": 0, "blas": 0, "ops": 0, "chat_template": 0,
    "cache": 1, "row_caches": 1, "images": 1, "sampling": 1, "processors": 1, "tokenizer": 1, "prompt": 1,
    "parallel": 1, "draft_vocab": 1,
    "models": 2,
    "loaders": 3, "export": 3,
    "drafting": 4, "speculative": 4,
    "engine": 5,
    "api": 6, "mlx_hybrid": 6,  # the package's __init__: the API
    "parsers": 7, "tool_grammars": 7, "server": 7, "cli": 7, "chat": 7, "convert": 7, "generate": 7,
}  # fmt: skip


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at any depth of its file."""
    found, graph = modules(), collections.defaultdict(set)
    for name, path in found.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in found else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in found and t != name}
    return graph


def floor(module: str) -> int:
    parts = module.split(".")[1:] or ["mlx_hybrid"]
    return FLOORS[parts[0]]


def test_every_module_has_a_floor():
    assert all(floor(name) >= 0 for name in modules())


def test_no_import_runs_upward():
    upward = [(a, b) for a, targets in imports().items() for b in targets if floor(b) > floor(a)]
    assert not upward


def test_no_import_cycle():
    graph, state, cycles = imports(), {}, []

    def visit(module, path):
        state[module] = "open"
        for target in graph[module]:
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in list(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles
