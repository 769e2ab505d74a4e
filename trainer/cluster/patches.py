"""The patch formats the local API applies. Pure: object in, patched copy out.

- `merge_patch(target, patch)`: JSON merge patch (RFC 7386): maps merge key by key, `null`
  removes a key, anything else (lists included) replaces.
- `strategic_merge_patch(target, patch)`: what the API server does for the strategic-merge
  patches the product sends. The only one is the node agent's, on a Node (annotations, the
  taint list, `spec.unschedulable`); `NodeSpec.taints` has no merge strategy in Kubernetes, so
  the list is replaced and the patch applies as a merge patch. Directives (`$patch`,
  `$retainKeys`, `$deleteFromPrimitiveList...`) are refused (ValueError): nothing here sends them,
  and a silent merge would hide it.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

DIRECTIVE_PREFIX = "$"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: the result of applying `patch` to `target` (neither is modified)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """See the module docstring; ValueError names a directive it does not apply."""
    _refuse_directives(patch, "")
    return merge_patch(target, patch)


def _refuse_directives(patch: Any, path: str) -> None:
    if isinstance(patch, Mapping):
        for key, value in patch.items():
            if str(key).startswith(DIRECTIVE_PREFIX):
                raise ValueError(f"{path or '.'}: the strategic-merge directive {key!r} is not applied here")
            _refuse_directives(value, f"{path}.{key}")
    elif isinstance(patch, list):
        for index, item in enumerate(patch):
            _refuse_directives(item, f"{path}[{index}]")
