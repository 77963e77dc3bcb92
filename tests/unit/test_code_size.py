"""Size limits of the product's code: no module over 600 lines, no function over 80; and
no module of the lab (lab/flannelpy_lab) over 600 lines either.

The modules and functions over a limit today are listed below with their size now. Each
may only shrink until it is split, and nothing may join the list: a module or function
that grows past a limit fails here with its name and size.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flannelpy", "cni_plugin")
LAB_PACKAGE = "lab/flannelpy_lab"
MODULE_LINES = 600
FUNCTION_LINES = 80

# Over the limit before the limit was enforced: to be split, never to grow.
MODULES_OVER: dict[str, int] = {}
FUNCTIONS_OVER: dict[str, int] = {}


def product_modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def functions(tree: ast.Module) -> list[tuple[str, int]]:
    """Every function and method with its qualified name and its length in lines."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                assert child.end_lineno is not None
                found.append((name, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")

    visit(tree, "")
    return found


def test_no_module_grows_past_600_lines() -> None:
    over = {}
    for path in product_modules():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        name = str(path.relative_to(REPO))
        if lines > MODULES_OVER.get(name, MODULE_LINES):
            over[name] = lines
    assert not over, (
        f"over {MODULE_LINES} lines (or grown past the size listed here): {over}; split the "
        "module by concept"
    )


def test_no_function_grows_past_80_lines() -> None:
    over = {}
    for path in product_modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for qualified, lines in functions(tree):
            name = f"{path.relative_to(REPO)}:{qualified}"
            if lines > FUNCTIONS_OVER.get(name, FUNCTION_LINES):
                over[name] = lines
    assert not over, f"over {FUNCTION_LINES} lines (or grown past the size listed here): {over}"


def test_the_lists_name_only_what_is_still_over() -> None:
    """A module or function split below its limit leaves the list, so it cannot grow back."""
    sizes = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in product_modules()}
    stale = [m for m in MODULES_OVER if sizes.get(m, 0) <= MODULE_LINES]
    lengths = {
        f"{p.relative_to(REPO)}:{q}": n
        for p in product_modules()
        for q, n in functions(ast.parse(p.read_text()))
    }
    stale += [f for f in FUNCTIONS_OVER if lengths.get(f, 0) <= FUNCTION_LINES]
    assert not stale, f"no longer over the limit: remove {stale} from the lists"


def test_no_lab_module_grows_past_600_lines() -> None:
    over = {}
    for path in sorted((REPO / LAB_PACKAGE).rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MODULE_LINES:
            over[str(path.relative_to(REPO))] = lines
    assert not over, f"lab modules over {MODULE_LINES} lines: {over}; split by concept"
