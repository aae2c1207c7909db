"""The docstring of each field of a dataclass: the string literal right after the field (the form
tyro and torchtitan read), taken from the class's source."""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (whitespace collapsed), for every annotated field of ``cls`` that has one."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
    out = {}
    for field, doc in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            out[field.target.id] = " ".join(doc.value.value.split())
    return out


__all__ = ["field_docs"]
