"""Static analysis and instrumentation of a HumanEval-style ``check(candidate)``.

The official harness runs ``check(candidate)`` whole, so the first failing assert hides all
later ones.  For partial credit we rewrite every counted ``assert`` in ``check`` into a
statement that records its own outcome and continues, while everything else (loops, helper
variables, imports, nested helpers) runs unchanged.  Counting is static so that ``total``
never depends on what the program did.

Used by the parent (counting, assert sources) and by the judge process (instrumentation),
so it imports nothing from the package.
"""

from __future__ import annotations

import ast
import builtins
import threading
from collections.abc import Iterator

HOOK = "_sandbox_"  # name of the recorder object the judge injects into the test namespace
SOURCE_CAP = 300


# CPython keeps the AST constructor's recursion depth in per-interpreter state, which two
# threads parsing at once can corrupt ("SystemError: AST constructor recursion depth
# mismatch", python/cpython#106905); environments score their branches in threads.
_AST_LOCK = threading.Lock()


def parse_python(source: str, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse``, one thread at a time (every parse of the package goes through here)."""
    with _AST_LOCK:
        return ast.parse(source, filename)


def parse_test_code(test_code: str) -> tuple[ast.Module, ast.FunctionDef | None]:
    """Parse trusted test code; return the module and its (last) top-level ``check``."""
    try:
        module = parse_python(test_code, "<test>")
    except SyntaxError as exc:
        raise ValueError(f"test_code does not parse: {exc.msg} (line {exc.lineno})") from None
    checks = [
        node
        for node in module.body
        if isinstance(node, ast.FunctionDef) and node.name == "check"
    ]
    return module, (checks[-1] if checks else None)


def counted_asserts(check: ast.FunctionDef) -> list[ast.Assert]:
    """Asserts inside ``check`` in source order, skipping constant tests (``assert True, ..``)."""
    return [
        node
        for node in _preorder(check)
        if isinstance(node, ast.Assert) and not isinstance(node.test, ast.Constant)
    ]


def _preorder(node: ast.AST) -> Iterator[ast.AST]:
    """Depth-first, source-ordered walk (``ast.walk`` is breadth-first)."""
    for child in ast.iter_child_nodes(node):
        yield child
        yield from _preorder(child)


def count_tests(test_code: str) -> int:
    """Number of counted assert statements in ``check``; 0 if there is no ``check``."""
    _, check = parse_test_code(test_code)
    return len(counted_asserts(check)) if check is not None else 0


def assert_sources(test_code: str) -> list[str]:
    """Source text of each counted assert, capped, in index order."""
    _, check = parse_test_code(test_code)
    if check is None:
        return []
    sources = []
    for node in counted_asserts(check):
        text = ast.get_source_segment(test_code, node) or ast.unparse(node)
        text = " ".join(text.split())
        sources.append(text if len(text) <= SOURCE_CAP else text[: SOURCE_CAP - 3] + "...")
    return sources


def free_names(module: ast.Module) -> list[str]:
    """Names the test code reads but never binds: they must come from the program.

    HumanEval tests call program helpers by name (``poly``, ``encode_cyclic``) because the
    official harness runs test and program in one namespace.  Over-approximating is harmless.
    """
    loaded: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    return sorted(loaded - bound - set(dir(builtins)))


def instrument(test_code: str) -> ast.Module:
    """Return the test module with ``check`` rewritten to record each assert and go on.

    Each counted assert becomes::

        _sandbox_.begin(i)                 # starts the per-assert deadline
        try: ok = _sandbox_.truth(TEST)
        except _sandbox_.Abort: raise      # total budget gone: stop everything
        except Exception as e: _sandbox_.fail(i, e)
        else: _sandbox_.passed(i) if ok else _sandbox_.failed(i, MSG)

    Each top-level statement of ``check`` is wrapped so that an exception outside an assert
    (say ``x = candidate(...)`` raising) fails the asserts of that statement and execution
    resumes with the next top-level statement.
    """
    module, check = parse_test_code(test_code)
    if check is None:
        raise ValueError("test_code defines no check() function")
    indices = {id(node): i for i, node in enumerate(counted_asserts(check))}
    rewriter = _AssertRewriter(indices)
    body: list[ast.stmt] = []
    for stmt in check.body:
        inside = tuple(indices[id(n)] for n in [stmt, *_preorder(stmt)] if id(n) in indices)
        rewritten = rewriter.visit(stmt)
        stmts = rewritten if isinstance(rewritten, list) else [rewritten]
        body.extend(_wrap_top_level(stmts, inside))
    check.body = body
    return ast.fix_missing_locations(module)


class _AssertRewriter(ast.NodeTransformer):
    def __init__(self, indices: dict[int, int]) -> None:
        self.indices = indices

    def visit_Assert(self, node: ast.Assert) -> ast.AST | list[ast.stmt]:
        index = self.indices.get(id(node))
        if index is None:
            return node
        if node.msg is None:
            on_false = f"{HOOK}.failed({index}, None)"
        else:  # the message is only evaluated on failure, like a real assert
            on_false = f"""try:
            _sandbox_msg = MSG
        except {HOOK}.Abort:
            raise
        except Exception:
            _sandbox_msg = None
        {HOOK}.failed({index}, _sandbox_msg)"""
        stmts = _template(
            f"""
{HOOK}.begin({index})
try:
    _sandbox_ok = {HOOK}.truth(TEST)
except {HOOK}.Abort:
    raise
except Exception as _sandbox_exc:
    {HOOK}.fail({index}, _sandbox_exc)
else:
    if _sandbox_ok:
        {HOOK}.passed({index})
    else:
        {on_false}
""",
            {"TEST": node.test, "MSG": node.msg},
        )
        # Generated nodes take the assert's position so tracebacks point at the test line.
        original = {id(sub) for sub in ast.walk(node)}
        for stmt in stmts:
            for sub in ast.walk(stmt):
                if id(sub) not in original and "lineno" in sub._attributes:
                    ast.copy_location(sub, node)
        return stmts


def _wrap_top_level(stmts: list[ast.stmt], inside: tuple[int, ...]) -> list[ast.stmt]:
    return _template(
        f"""
try:
    STMT
except {HOOK}.Abort:
    raise
except Exception as _sandbox_exc:
    {HOOK}.block_failed({inside!r}, _sandbox_exc)
{HOOK}.block_done()
""",
        {"STMT": stmts},
    )


def _template(source: str, holes: dict[str, object]) -> list[ast.stmt]:
    """Parse ``source``; replace placeholder names by expressions, or by statement lists."""
    tree = parse_python(source)

    class Fill(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            return holes.get(node.id) or node

        def visit_Expr(self, node: ast.Expr) -> ast.AST:
            value = node.value
            if isinstance(value, ast.Name) and isinstance(holes.get(value.id), list):
                return holes[value.id]
            return self.generic_visit(node)

    return Fill().visit(tree).body
