"""The package stays readable in one sitting: no function over MAX_FUNCTION_LINES lines, and
the command's own module (the parser and the thinnest commands) under MAX_CLI_LINES."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "python" / "ferrolm"
MAX_FUNCTION_LINES = 100
MAX_CLI_LINES = 600


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """(name, first line, length) of each function or method in ``source`` longer than ``limit``
    lines, its decorators, docstring and comments included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - first + 1
            if length > limit:
                found.append((node.name, first, length))
    return found


def test_long_functions_are_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == [("f", 1, MAX_FUNCTION_LINES + 1)]
    assert long_functions(f"class C:\n    def g(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n")[0][0] == "g"
    assert long_functions("def f():\n    return 1\n") == []


def test_no_function_in_the_package_is_over_the_limit():
    files = sorted(PACKAGE_ROOT.rglob("*.py"))
    assert len(files) > 30  # the package was found
    over = [
        f"{path.relative_to(PACKAGE_ROOT)}:{line} {name} ({length} lines)"
        for path in files
        for name, line, length in long_functions(path.read_text(encoding="utf-8"))
    ]
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(over)


def test_the_cli_module_stays_thin():
    lines = len((PACKAGE_ROOT / "app" / "cli.py").read_text(encoding="utf-8").splitlines())
    assert 100 < lines < MAX_CLI_LINES
