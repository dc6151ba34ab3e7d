"""No function or method of the package is longer than MAX_FUNCTION_LINES, and no source file of it
longer than MAX_FILE_LINES: a longer function is split along its steps into functions whose names
say what each step does, a longer module along its seams into modules of one owner each."""

from __future__ import annotations

import ast

from conftest import REPO

MAX_FUNCTION_LINES = 120
MAX_FILE_LINES = 800


def _too_long(text: str, name: str) -> list[str]:
    """`name:line function (N lines)` for each function or method of one module's `text` over the
    limit, counted from its `def` to its last line."""
    return [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(text, name))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_of_the_package_is_over_the_limit() -> None:
    modules = sorted((REPO / "nccltune").rglob("*.py"))
    assert len(modules) > 50  # the package was found
    found = [hit for path in modules for hit in _too_long(path.read_text(), str(path.relative_to(REPO)))]
    assert found == [], f"over {MAX_FUNCTION_LINES} lines, split them: {found}"


def test_the_scan_names_a_function_over_the_limit_and_its_length() -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 2))
    text = (f"def short():\n    pass\n\n\nclass C:\n    async def at_limit(self):\n{body}\n        return 0\n\n"
            f"    def over(self):\n{body}\n        x = 0\n        return x\n")
    over_at = text.splitlines().index("    def over(self):") + 1
    # at_limit is exactly MAX_FUNCTION_LINES long and passes; over is one line more.
    assert _too_long(text, "m.py") == [f"m.py:{over_at} over ({MAX_FUNCTION_LINES + 1} lines)"]


def test_no_source_file_of_the_package_is_over_the_limit() -> None:
    sources = [p for p in sorted((REPO / "nccltune").rglob("*")) if p.suffix in (".py", ".c", ".h") and p.is_file()]
    assert any(p.suffix == ".c" for p in sources)  # the plugins' sources are counted too
    found = [f"{p.relative_to(REPO)} ({n} lines)" for p in sources
             if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert found == [], f"over {MAX_FILE_LINES} lines, split them: {found}"
