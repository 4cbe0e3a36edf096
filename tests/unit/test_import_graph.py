"""The package's imports point one way (docs/architecture.md), read from the source with
``ast`` (nothing is imported or run).

Every ``import`` and ``from ... import`` of every module counts, at any depth (a lazy
import inside a function too: it is a dependency all the same). They give a graph of
modules and, one level up, of the package's folders (``rl/``, ``rollout/``...). The test
refuses:

- an import cycle between modules;
- two folders importing each other, or any longer cycle of folders;
- an import across the trainer/engine seam that points back: ``weight_sync/`` importing
  ``rollout/`` or ``rl/``, ``rollout/`` importing ``rl/`` (the seam runs rl/ -> rollout/
  -> weight_sync/; rollout/ takes only ``weight_sync.contract`` and the names it starts
  vLLM with).

The top-level modules (``cli``, ``config``, ``flags``, ``config_file``, ``plot``) are not
folders: ``config`` composes every folder's config and the stages take the composed
``RunConfig``, which is the one way a folder and a top-level module meet in both
directions (a module cycle would still be refused).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_logra"
ROOT = PACKAGE.name
# what rollout/ may take of weight_sync/: the seam's contract, and the names of the
# vLLM-side plugin it starts servers with (environment variables, no code of a push)
ROLLOUT_MAY_IMPORT = {f"{ROOT}.weight_sync.contract", f"{ROOT}.weight_sync.cpu_live_weights",
                      f"{ROOT}.weight_sync.vllm_plugin"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports (a ``from X import y`` of a submodule y:
    X.y; of a name in X: X)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                       else source for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module
                target = target.rpartition(".")[0]
            if target.startswith(ROOT + ".") and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def folder(module: str) -> str | None:
    """``rl`` for ``megatron_logra.rl.stage``; None for a top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else None


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _folder_edges(graph: dict[str, set[str]]) -> dict[str, dict[str, list[str]]]:
    """{folder: {folder it imports: ["module -> module", ...]}}."""
    out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, targets in graph.items():
        for target in targets:
            a, b = folder(module), folder(target)
            if a and b and a != b:
                out[a][b].append(f"{module} -> {target}")
    return out


def test_the_graph_is_read():
    """The parse sees what the package does import (a check that cannot pass on an empty
    or misread graph)."""
    graph = _graph()
    assert f"{ROOT}.rl.synced_engines" in graph
    assert {f"{ROOT}.rollout.engines", f"{ROOT}.weight_sync.sync"} <= \
        graph[f"{ROOT}.rl.synced_engines"]
    assert f"{ROOT}.weight_sync.contract" in graph[f"{ROOT}.rollout.vllm_server"]
    assert f"{ROOT}.rollout.server_process" in graph[f"{ROOT}.rollout.vllm_server"]  # lazy
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_import_cycle():
    assert _cycles(_graph()) == []


def test_no_folders_import_each_other_nor_any_folder_cycle():
    edges = _folder_edges(_graph())
    mutual = {(a, b): edges[a][b][:3] + edges[b][a][:3] for a in edges for b in edges[a]
              if a < b and a in edges.get(b, {})}
    assert mutual == {}
    assert _cycles({a: set(targets) for a, targets in edges.items()}) == []


def test_the_seam_runs_rl_to_rollout_to_weight_sync():
    back = [f"{m} -> {t}" for m, targets in _graph().items() for t in targets
            if (folder(m) == "weight_sync" and folder(t) in ("rollout", "rl"))
            or (folder(m) == "rollout" and folder(t) == "rl")
            or (folder(m) == "rollout" and folder(t) == "weight_sync"
                and t not in ROLLOUT_MAY_IMPORT)]
    assert back == []
