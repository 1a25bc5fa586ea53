"""The import structure: every module under lightllm/ imports in a fresh interpreter, no
import cycle exists, and the engine core (lightllm.server, lightllm.common) never reaches
lightllm.tools or benchmarks.

The graph is read from the source (ast), with imports inside functions included: a lazy
import is still a dependency, and a cycle of lazy imports is still a cycle.
"""
import ast
import json
import os
import subprocess
import sys
from importlib.util import find_spec
from typing import Dict, List, Optional, Set

import pytest

from unit_tests.data_paths import REPO_ROOT

# Top-level folders whose modules make up the graph
GRAPH_ROOTS = ("lightllm", "benchmarks")
# Third-party packages only the tools and tests need (setup.py's [tools] extra): a module that
# needs one is skipped, with the reason, when it is not installed; any other failure fails.
OPTIONAL_PACKAGES = ("gguf", "matplotlib", "httpx")
ENGINE_CORE = ("lightllm.server", "lightllm.common")
NOT_FOR_THE_CORE = ("lightllm.tools", "benchmarks")
IMPORT_ALL_TIMEOUT_S = 300

# Imports each module named on the command line, in order; prints one JSON result per module.
_IMPORT_ALL = """
import importlib, json, sys, traceback
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        result = {"ok": True}
    except ModuleNotFoundError as e:
        result = {"ok": False, "missing": e.name, "error": traceback.format_exc()}
    except BaseException:
        result = {"ok": False, "missing": None, "error": traceback.format_exc()}
    print(json.dumps({"module": name, **result}), flush=True)
"""


def _source_modules() -> Dict[str, str]:
    """Dotted module name -> file, for every .py under GRAPH_ROOTS (packages by their __init__)."""
    modules = {}
    for root in GRAPH_ROOTS:
        for folder, _, files in os.walk(os.path.join(REPO_ROOT, root)):
            for file in sorted(files):
                if not file.endswith(".py"):
                    continue
                path = os.path.join(folder, file)
                parts = os.path.relpath(path, REPO_ROOT)[: -len(".py")].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join(parts)] = path
    return modules


def _imported_modules(name: str, path: str, modules: Dict[str, str]) -> Set[str]:
    """The modules of `modules` that `name` imports anywhere in its file."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: drop level - 1 trailing parts of the package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
    found = set()
    for target in targets:
        while target and target not in modules:  # a name inside a module: that module
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _import_graph() -> Dict[str, Set[str]]:
    modules = _source_modules()
    return {name: _imported_modules(name, path, modules) for name, path in modules.items()}


def _find_cycle(graph: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle as [a, b, ..., a], or None (iterative depth-first search)."""
    done: Set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path = [start], {start}
        pending = [iter(sorted(graph[start]))]
        while pending:
            nxt = next(pending[-1], None)
            if nxt is None:
                done.add(path[-1])
                on_path.discard(path.pop())
                pending.pop()
            elif nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                pending.append(iter(sorted(graph[nxt])))
    return None


def _path_to(graph: Dict[str, Set[str]], start: str, prefixes) -> Optional[List[str]]:
    """An import chain from `start` to a module under one of `prefixes`, or None (breadth first)."""
    parent = {start: None}
    queue = [start]
    for module in queue:
        if module != start and _is_under(module, prefixes):
            chain = [module]
            while parent[chain[-1]] is not None:
                chain.append(parent[chain[-1]])
            return chain[::-1]
        for nxt in sorted(graph[module]):
            if nxt not in parent:
                parent[nxt] = module
                queue.append(nxt)
    return None


def _is_under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


LIGHTLLM_MODULES = sorted(m for m in _source_modules() if _is_under(m, ("lightllm",)))


def test_finds_cycles_and_chains():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    assert _path_to(graph, "d", ("c",)) == ["d", "a", "b", "c"]


def test_no_import_cycle():
    cycle = _find_cycle(_import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("core", ENGINE_CORE)
def test_engine_core_never_reaches_tools_or_benchmarks(core):
    graph = _import_graph()
    for module in sorted(m for m in graph if _is_under(m, (core,))):
        chain = _path_to(graph, module, NOT_FOR_THE_CORE)
        assert chain is None, "the engine core reaches a tool: " + " -> ".join(chain)


@pytest.fixture(scope="module")
def import_results() -> Dict[str, dict]:
    """Every lightllm module imported, in one fresh interpreter; results by module."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *LIGHTLLM_MODULES], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=IMPORT_ALL_TIMEOUT_S)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["module"]] = result
    assert proc.returncode == 0, f"the importing interpreter failed:\n{proc.stderr[-4000:]}"
    return results


@pytest.mark.parametrize("module", LIGHTLLM_MODULES)
def test_module_imports_in_a_fresh_interpreter(module, import_results):
    result = import_results[module]
    if result["ok"]:
        return
    missing = result["missing"]
    if missing in OPTIONAL_PACKAGES and find_spec(missing) is None:
        pytest.skip(f"needs the optional package {missing!r} (setup.py's [tools] extra)")
    pytest.fail(f"importing {module} failed:\n{result['error']}")
