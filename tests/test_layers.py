"""Imports flow one way: the user API -> ``interlace.cluster`` -> ``interlace.workers``, and all
three may import ``interlace.core``, which imports none of them.

Read from the source with ``ast``, so a new upward import fails here before it becomes a cycle
that only a function-local import keeps from breaking. An ``interlace`` import inside a function
body is allowed only with a one-line reason beside it (a comment on its line or the line above):
deferring a heavy optional dependency (Ray, vLLM, FastAPI) or crossing a process boundary.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"interlace": ROOT / "driver", "interlace.cluster": ROOT / "cluster", "interlace.workers": ROOT / "workers"}
LAYERS = {"interlace.core": 0, "interlace.workers": 1, "interlace.cluster": 2}  # anything else of interlace: 3, the API


def layer(module: str) -> int:
    for prefix, rank in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return rank
    return 3


def modules() -> dict[str, Path]:
    """Every module of the distribution, by its import name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            found[".".join((package, *parts)).removesuffix(".__init__")] = path
    return found


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def interlace_imports(source: str) -> list[tuple[str, int, bool, bool]]:
    """(imported module, line, inside a function body, only for type checking) for each import of
    an ``interlace`` module. ``from interlace import x`` counts as importing ``interlace``."""
    found = []

    def visit(node: ast.AST, in_function: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function, typing_only) for a in child.names
                             if a.name.split(".")[0] == "interlace")
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").split(".")[0] == "interlace":
                found.append((child.module, child.lineno, in_function, typing_only))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)),
                  typing_only or _type_checking_block(child))

    visit(ast.parse(source), False, False)
    return found


def upward_imports(name: str, source: str) -> list[str]:
    return [f"{name}:{line} imports {target}" for target, line, _, _ in interlace_imports(source)
            if layer(target) > layer(name)]


def unexplained_local_imports(name: str, source: str) -> list[str]:
    lines = source.splitlines()

    def explained(line: int) -> bool:
        return "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")

    return [f"{name}:{line} imports {target} inside a function with no reason given"
            for target, line, in_function, typing_only in interlace_imports(source)
            if in_function and not typing_only and not explained(line)]


def test_imports_flow_one_way():
    wrong = [w for name, path in modules().items() for w in upward_imports(name, path.read_text())]
    assert not wrong, "upward imports (API -> cluster -> workers, all -> core):\n" + "\n".join(wrong)


def test_imports_inside_functions_say_why():
    wrong = [w for name, path in modules().items() for w in unexplained_local_imports(name, path.read_text())]
    assert not wrong, "\n".join(wrong)


def test_the_checks_catch_what_they_are_for():
    upward = "from interlace.model import Model\n"
    assert upward_imports("interlace.cluster.replica", upward) == ["interlace.cluster.replica:1 imports interlace.model"]
    assert upward_imports("interlace.workers.saves", "import interlace.cluster.config\n")
    assert upward_imports("interlace.core.trace", "from interlace.workers.points import Point\n")
    assert not upward_imports("interlace.model", "from interlace.workers.points import Point\n")
    local = textwrap.dedent("""
        def f():
            from interlace.cluster.engine import start_engine
        def g():
            from interlace.cluster.engine import start_engine  # lazy: vLLM
    """)
    assert unexplained_local_imports("interlace.model", local) == [
        "interlace.model:3 imports interlace.cluster.engine inside a function with no reason given"]


def test_a_worker_rank_imports_neither_the_user_api_nor_ray():
    """What a vLLM rank loads (the worker extension and the interleaver) pulls in no user-facing
    module, no cluster module and no Ray: ``import interlace`` itself is lazy."""
    code = ("import sys, interlace.workers.extension, interlace.workers.interleaver, interlace.workers.taps\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('interlace.cluster', 'interlace.model',"
            " 'interlace.cluster_client', 'interlace.remote', 'interlace.sweep'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded
