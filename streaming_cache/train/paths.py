"""Keeping user-supplied names inside the folders they are meant for.

Node inputs such as a cache name or a dataset folder are strings a workflow file can set to anything; they are
resolved and checked by real path (symbolic links followed), so ``../../etc`` or a link pointing outside is
refused with a clear error instead of being read or written.
"""

from __future__ import annotations

import os


class PathError(ValueError):
    """A name that would leave its allowed folders, or that is not a usable name."""


def resolve_inside(name: str, roots: list[str], *, what: str = "path") -> str:
    """The real path of ``name`` taken relative to the first of ``roots`` (an absolute ``name`` is taken as is),
    which must lie inside one of ``roots``. The target need not exist."""
    if not isinstance(name, str) or not name.strip():
        raise PathError(f"the {what} is empty; give a name such as 'my_dataset'")
    if "\0" in name:
        raise PathError(f"the {what} {name!r} contains a NUL character")
    if not roots:
        raise PathError(f"no folder is configured for the {what}")
    real_roots = [os.path.realpath(r) for r in roots]
    target = os.path.realpath(os.path.join(real_roots[0], name.strip()))
    for root in real_roots:
        if target == root or target.startswith(root.rstrip(os.sep) + os.sep):
            return target
    raise PathError(f"the {what} {name!r} resolves to {target}, outside the allowed folders "
                    f"({', '.join(real_roots)}); use a name inside them")


def plain_name(name: str, *, what: str = "name") -> str:
    """A single file-name component: no separators, not '.', '..' or hidden."""
    n = name.strip() if isinstance(name, str) else ""
    if not n or n in (".", "..") or n.startswith(".") or any(c in n for c in "/\\\0:"):
        raise PathError(f"the {what} {name!r} must be a plain name (letters, digits, '_', '-', no slashes)")
    return n
