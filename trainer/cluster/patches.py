"""The patch formats the local API applies. Pure: object in, patched copy out.

- `merge_patch(target, patch)`: JSON merge patch (RFC 7386): maps merge key by key, `null`
  removes a key, anything else (lists included) replaces.
- `strategic_merge_patch(target, patch)`: what the API server does for the strategic-merge
  patches the product sends. The only one is the node agent's, on a Node (annotations, the
  taint list, `spec.unschedulable`); `NodeSpec.taints` has no merge strategy in Kubernetes, so
  the list is replaced and the patch applies as a merge patch. Directives (`$patch`,
  `$retainKeys`, `$deleteFromPrimitiveList...`) are refused (ValueError): nothing here sends them,
  and a silent merge would hide it.
- `json_patch(target, ops)`: JSON patch (RFC 6902): `add`, `remove`, `replace` and `test` at
  JSON pointers (RFC 6901: `~1` is `/`, `~0` is `~`; `-` appends to a list). ValueError names the
  op that does not apply (a missing path, a failed test); the target is not modified.
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


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ValueError(f"JSON pointer {path!r} does not start with /")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _child(node: Any, key: str, path: str) -> Any:
    if isinstance(node, dict) and key in node:
        return node[key]
    if isinstance(node, list) and key.isdigit() and int(key) < len(node):
        return node[int(key)]
    raise ValueError(f"{path}: no such path")


def _apply_op(doc: Any, op: Mapping[str, Any]) -> Any:
    kind, path = op.get("op"), str(op.get("path", ""))
    parts = _pointer(path)
    if kind == "test":
        node = doc
        for part in parts:
            node = _child(node, part, path)
        if node != op.get("value"):
            raise ValueError(f"test {path}: the value differs")
        return doc
    if not parts:
        if kind in ("add", "replace"):
            return copy.deepcopy(op.get("value"))
        raise ValueError(f"{kind} of the whole document")
    parent = doc
    for part in parts[:-1]:
        parent = _child(parent, part, path)
    last = parts[-1]
    if isinstance(parent, dict):
        if kind == "add" or (kind == "replace" and last in parent):
            parent[last] = copy.deepcopy(op.get("value"))
        elif kind == "remove" and last in parent:
            del parent[last]
        else:
            raise ValueError(f"{kind} {path}: no such path")
    elif isinstance(parent, list):
        index = len(parent) if last == "-" and kind == "add" else (int(last) if last.isdigit() else -1)
        if kind == "add" and 0 <= index <= len(parent):
            parent.insert(index, copy.deepcopy(op.get("value")))
        elif kind in ("remove", "replace") and 0 <= index < len(parent):
            if kind == "remove":
                del parent[index]
            else:
                parent[index] = copy.deepcopy(op.get("value"))
        else:
            raise ValueError(f"{kind} {path}: no such index")
    else:
        raise ValueError(f"{kind} {path}: the parent is not an object or a list")
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    """See the module docstring."""
    if not isinstance(ops, list):
        raise ValueError("a JSON patch is a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, Mapping) or op.get("op") not in ("add", "remove", "replace", "test"):
            raise ValueError(f"JSON patch operation {op!r}: only add, remove, replace and test are applied")
        doc = _apply_op(doc, op)
    return doc
