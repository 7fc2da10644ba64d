"""The house's layering: every import in xtrain/ points down (or sideways without a cycle), the
way the README's layout section draws it. Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "xtrain"
# Lowest first. A module may import from its own layer (without cycles) or from lower layers.
LAYERS = [
    ["xtrain.config", "xtrain.errors", "xtrain.paths", "xtrain.deadline", "xtrain.compat", "xtrain.units",
     "xtrain.naming", "xtrain.limits", "xtrain.import_hooks"],
    ["xtrain.model", "xtrain.data", "xtrain.checkpoint", "xtrain.optim"],
    ["xtrain.plan", "xtrain.hardware", "xtrain.parallelism", "xtrain.inputs"],
    ["xtrain.engines", "xtrain.xla", "xtrain.observe", "xtrain.evals"],
    ["xtrain.train", "xtrain.preflight"],
    ["xtrain.modes", "xtrain.sweeps", "xtrain.launcher", "xtrain.report"],
    ["xtrain.cli", "xtrain.__main__", "xtrain.data.__main__"],
]
FORBIDDEN = ("launch", "hydra_plugins")  # the Hydra plugin shims import xtrain, never the reverse


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports(path: Path, known: dict) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in the file, resolved to the deepest known module
    (``from xtrain import compat`` names xtrain.compat)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            out += [(node.lineno, t) for t in targets] or [(node.lineno, node.module)]
    return out


def layer_of(module: str) -> int | None:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return None if best is None else best[0]


def graph():
    known = modules()
    edges = {}
    for name, path in known.items():
        edges[name] = [(line, target) for line, target in imports(path, known)
                       if target.startswith(("xtrain",) + FORBIDDEN)]
    return known, edges


def test_every_module_has_a_layer():
    known, _ = graph()
    assert [m for m in known if m != "xtrain" and layer_of(m) is None] == []


def test_no_import_runs_up_the_layers_or_out_to_launch():
    known, edges = graph()
    upward = []
    for name, targets in edges.items():
        for line, target in targets:
            where = f"{known[name].relative_to(PACKAGE.parent)}:{line} imports {target}"
            if target.startswith(FORBIDDEN):
                upward.append(where + " (the launch/ plugins sit outside xtrain)")
            elif name != "xtrain" and target != "xtrain" and layer_of(target) > layer_of(name):
                upward.append(where + f" (layer {layer_of(target)} above {layer_of(name)})")
    assert upward == []


def test_no_import_cycles():
    known, edges = graph()
    resolved = {n: sorted({t for _, t in ts if t in known and t != n}) for n, ts in edges.items()}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in resolved[node]:
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in resolved:
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_model_and_data_import_nothing_of_training_or_launching():
    _, edges = graph()
    banned = ("xtrain.train", "xtrain.xla", "xtrain.preflight", "xtrain.engines", "xtrain.launcher",
              "xtrain.cli", "xtrain.modes") + FORBIDDEN
    found = [(n, t) for n, ts in edges.items() if n.startswith(("xtrain.model", "xtrain.data"))
             for _, t in ts if t.startswith(banned)]
    assert found == []


def test_modules_and_functions_stay_small():
    """No module over 400 lines; no function over 60 lines unless a comment right above it, or
    its docstring, says why it is long ("Long: ...")."""
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > 400:
            too_long.append(f"{path.name}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                doc = ast.get_docstring(node) or ""
                above = lines[node.lineno - 2] if node.lineno > 1 else ""
                if length > 60 and "long:" not in doc.lower() and "long:" not in above.lower():
                    too_long.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    assert too_long == []
