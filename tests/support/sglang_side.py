"""Telling SGLang's own defects from ours: the SGLang harness (`tools/compat/sglang_compat.py`) reports a step as
"SGLang-side" only through `sglang_missing_attribute`, here so that its test can check it without SGLang."""

from __future__ import annotations

import os
import traceback


def sglang_missing_attribute(mm_processor, exc: BaseException) -> str | None:
    """Why `exc` is SGLang's own defect, or None when it may not be.

    It is when SGLang's processor code read an attribute of the processor that no class of the processor
    defines or assigns anywhere in its source: then no checkpoint (config, tokenizer, processor files) and no
    constructor argument can provide it, and every checkpoint of the architecture stops there. The reason names
    where the attribute is read (file:line in the sglang package). Anything else (a wrong count, a missing
    field, an attribute that some constructor would set) is not classified, so it stays a failure."""
    import ast
    import inspect
    import textwrap

    name = getattr(exc, "name", None)
    if not isinstance(exc, AttributeError) or not name or getattr(exc, "obj", None) is not mm_processor:
        return None

    def may_set(node) -> bool:
        """`x.<name> = ...` in any form (tuple targets, augmented, loop targets), or a `setattr(self|cls, ...)`."""
        if isinstance(node, ast.Attribute):
            return node.attr == name and isinstance(node.ctx, (ast.Store, ast.Del))
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))

    for cls in type(mm_processor).__mro__[:-1]:
        if name in vars(cls):
            return None
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError, SyntaxError):
            return None
        if any(may_set(node) for node in ast.walk(tree)):
            return None
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    where = frame.filename.replace(os.sep, "/")
    where = where[where.rfind("sglang/srt/"):] if "sglang/srt/" in where else os.path.basename(where)
    owner = next((cls.__name__ + "." for cls in type(mm_processor).__mro__ if frame.name in vars(cls)), "")
    classes = ", ".join(cls.__name__ for cls in type(mm_processor).__mro__[:-1])
    return (f"{type(mm_processor).__name__} uses {owner}{frame.name}, which reads self.{name} at "
            f"{where}:{frame.lineno}; none of {classes} defines or sets it, so no checkpoint can provide it")
