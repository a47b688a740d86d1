"""User code named in a config: ``pkg.module:function`` strings resolved to callables.

One resolver for every such field (``trainer.loss.custom``, an echo filter's ``import_path``), so
they accept the same spellings and fail the same way, each error naming its field and the fix.
It imports nothing of jaxrl, so any layer can use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Any


@cache
def resolve_import_path(path: str, field: str) -> Callable[..., Any]:
    """Import ``pkg.module:function`` or ``pkg.module.function``. Errors are ``ValueError``s (which
    pydantic reports as validation errors) starting ``{field} = {path!r}:``."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"{field} = {path!r}: expected 'pkg.module:function' or 'pkg.module.function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{field} = {path!r}: cannot import module {module_name!r} ({e}); "
            "check the spelling and that the package is installed or on PYTHONPATH"
        ) from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        # ValueError, not TypeError: pydantic turns only ValueError into a ValidationError.
        raise ValueError(f"{field} = {path!r}: module {module_name!r} has no callable {attr!r}")  # noqa: TRY004
    return fn
