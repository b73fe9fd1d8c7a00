"""Reading model-written code without running it: extraction, assembly and static checks.

Models wrap code in markdown fences, add prose, or repeat the problem. We keep what the task
asked for: the imports and function definitions of the answer, and assemble the program as
``problem context + aux answer + main answer``. Nothing here executes code; parsing with
``ast`` is safe on any input.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass

from llm_marl_envs.sandbox.checks import parse_python

_FENCE_LINE = re.compile(r"^[ \t]*```.*$", re.M)
_CODE_LINE = re.compile(r"^(?:async\s+def |def |class |import |from \S+ import |@)", re.M)


def _parse(source: str) -> ast.Module | None:
    try:
        return parse_python(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def code_region(text: str) -> str:
    """The code of an answer: its fenced blocks if it has any, else the whole text.

    Fences pair up in order, and a block left open runs to the end. An answer that starts
    with code and closes a fence it never opened (a model that began inside the block) has
    its text before that fence as its first block, not the prose after it.
    """
    fences = list(_FENCE_LINE.finditer(text))
    if not fences:
        return textwrap.dedent(text)
    cuts = [0, *(point for fence in fences for point in (fence.start(), fence.end())), len(text)]
    pieces = [text[start:end] for start, end in zip(cuts[::2], cuts[1::2], strict=True)]
    opened_before = len(fences) % 2 == 1 and _CODE_LINE.search(pieces[0]) is not None
    blocks = [block for block in pieces[0 if opened_before else 1 :: 2] if block.strip()]
    return textwrap.dedent("\n".join(block.strip("\n") for block in blocks))


_KEPT_STATEMENT = re.compile(r"(async\s+def |def |class |@|import |from \S+ import )")
_DEFINITION = re.compile(r"(?:async\s+)?def\s+(\w+)\s*\(|class\s+(\w+)\b")


def top_level_chunks(code: str) -> list[str]:
    """Split code into top-level statements, each with its body, as written.

    Valid code is split by its syntax tree (multi-line strings stay whole). Code with a syntax
    error is split at lines that start at column 0, so the broken definition is isolated and the
    rest still counts. Lines of prose and top-level calls (a model's ``print(f(3))`` demo) form
    chunks too and are dropped by the caller: they would run when the program loads.
    """
    lines = code.splitlines()
    tree = _parse(code)
    if tree is not None:
        return [
            "\n".join(lines[_first_line(node) - 1 : node.end_lineno]).rstrip() for node in tree.body
        ]
    chunks: list[list[str]] = []
    for line in lines:
        starts_statement = line[:1] not in ("", " ", "\t", "#", ")", "]", "}")
        after_decorator = bool(chunks) and chunks[-1][-1].startswith("@")
        if not chunks or (starts_statement and not after_decorator):
            chunks.append([line])
        else:
            chunks[-1].append(line)
    return ["\n".join(chunk).rstrip() for chunk in chunks if "".join(chunk).strip()]


def _first_line(node: ast.stmt) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(decorator.lineno for decorator in decorators)])


def _defined_name(chunk: str) -> str | None:
    for line in chunk.splitlines():
        if not line.startswith("@"):
            match = _DEFINITION.match(line)
            return (match.group(1) or match.group(2)) if match else None
    return None


@dataclass(frozen=True)
class Snippet:
    """What one agent contributed: its imports and definitions as written, and its target."""

    source: str  # the kept chunks, verbatim, ready to be placed in the program
    target_source: str  # the chunk defining the requested function ("" when missing)
    target: (
        ast.FunctionDef | ast.AsyncFunctionDef | None
    )  # its syntax tree, None if it does not parse


def extract_definitions(text: str, target: str, exclude: frozenset[str] = frozenset()) -> Snippet:
    """Imports and definitions of an answer, the function ``target`` among them.

    Nothing is repaired: a definition with a syntax error is kept as written, so that the
    syntax level of the reward sees what the model wrote. Definitions named in ``exclude`` are
    dropped (the helper agent cannot redefine the main function, nor the main agent the helper).
    """
    kept: list[str] = []
    target_source = ""
    for chunk in top_level_chunks(code_region(text)):
        if not _KEPT_STATEMENT.match(chunk):
            continue
        name = _defined_name(chunk)
        if name in exclude:
            continue
        if name == target and not target_source:
            target_source = chunk
        kept.append(chunk)
    tree = _parse(target_source) if target_source else None
    function = next(
        (
            node
            for node in (tree.body if tree else [])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == target
        ),
        None,
    )
    return Snippet("\n\n".join(kept), target_source, function)


def problem_context(prompt: str, entry_point: str) -> str:
    """Everything the problem statement defines except the function to write (imports, helpers).

    HumanEval prompts sometimes define helpers the solution needs (``poly``, ``encode_cyclic``):
    the official harness runs prompt + completion, so the program must keep them too.
    """
    tree = _parse(prompt)
    if tree is None:
        return "\n".join(
            line for line in prompt.splitlines() if re.match(r"(import |from \S+ import )", line)
        )
    return "\n\n".join(
        ast.unparse(node)
        for node in tree.body
        if not (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point
        )
        and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
    )


def returns_value(snippet: Snippet) -> bool:
    """A ``return <value>`` in the function's own body (not in a nested function).

    A definition that does not parse is judged by its text, so that a syntax error is charged
    to the syntax level, not to the structure level as well.
    """
    function = snippet.target
    if function is None:
        return bool(re.search(r"^[ \t]+return[ \t]*[^\s;#]", snippet.target_source, re.M))
    stack = list(function.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return) and node.value is not None:
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return False


@dataclass(frozen=True)
class AuxUsage:
    calls_aux: bool
    thin_wrapper: (
        bool  # main only forwards to aux: ``return aux(...)`` or ``x = aux(...); return x``
    )
    ignores_result: bool  # every call of aux discards its result (or stores it, never read)


def _is_aux_call(node: ast.AST | None, helper: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == helper


def _body_without_docstring(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.stmt]:
    body = list(function.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def aux_usage(main: ast.FunctionDef | ast.AsyncFunctionDef | None, helper: str = "aux") -> AuxUsage:
    if main is None:
        return AuxUsage(False, False, False)
    calls = [node for node in ast.walk(main) if _is_aux_call(node, helper)]
    if not calls:
        return AuxUsage(False, False, False)
    read = {
        node.id for node in ast.walk(main) if isinstance(node, ast.Name)
        and isinstance(node.ctx, ast.Load)
    }
    discarded = set()
    for stmt in ast.walk(main):
        if isinstance(stmt, ast.Expr) and _is_aux_call(stmt.value, helper):
            discarded.add(id(stmt.value))  # aux(x) as a statement
        elif (
            isinstance(stmt, (ast.Assign, ast.AnnAssign))
            and _is_aux_call(stmt.value, helper)
            and all(
                isinstance(target, ast.Name) and target.id not in read
                for target in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
            )
        ):
            discarded.add(id(stmt.value))  # _ = aux(x), with _ never read
    ignores_result = all(id(call) in discarded for call in calls)

    body = _body_without_docstring(main)
    thin = (
        len(body) == 1 and isinstance(body[0], ast.Return) and _is_aux_call(body[0].value, helper)
    ) or (
        len(body) == 2
        and isinstance(body[0], ast.Assign)
        and len(body[0].targets) == 1
        and isinstance(body[0].targets[0], ast.Name)
        and _is_aux_call(body[0].value, helper)
        and isinstance(body[1], ast.Return)
        and isinstance(body[1].value, ast.Name)
        and body[1].value.id == body[0].targets[0].id
    )
    return AuxUsage(True, thin, ignores_result)


def binds_name(source: str, name: str) -> bool:
    """Whether code binds ``name`` anywhere, at any depth, in any way Python allows.

    A main answer that binds ``aux`` itself (``def aux`` at any level, ``aux = ...``, a
    parameter, an import, ``global aux``, a loop or comprehension target, ``except ... as
    aux``, a match capture, a walrus) means to stand in for the helper, so it forfeits the
    cooperation bonus, even where the program drops the binding (a top-level ``def aux``).
    Code that does not parse counts as binding it (such a program never gets that far).
    """
    tree = _parse(source)
    if tree is None:
        return True
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound = [node.name]
        elif isinstance(node, ast.Name):
            bound = [node.id] if isinstance(node.ctx, (ast.Store, ast.Del)) else []
        elif isinstance(node, ast.arg):
            bound = [node.arg]
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound = list(node.names)
        elif isinstance(node, ast.alias):
            bound = [node.asname or node.name.split(".")[0]]
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
            bound = [node.name]
        elif isinstance(node, ast.MatchMapping):
            bound = [node.rest]
        else:
            bound = []
        if name in bound:
            return True
    return False


def parses(program: str) -> tuple[bool, str]:
    """Whether the program compiles, with a one-line reason when it does not."""
    try:
        compile(program, "<program>", "exec", dont_inherit=True)
    except SyntaxError as error:
        return False, f"SyntaxError: {error.msg} (line {error.lineno})"
    except (ValueError, RecursionError, MemoryError) as error:
        return False, f"{type(error).__name__}: {error}"
    return True, ""
