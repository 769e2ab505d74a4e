"""Label and field selectors as the API server applies them. Pure.

- labels: the `{key: value}` equality selectors the product sends (`spotguard.kube.api`
  turns them into `k=v,...`); every pair must match.
- fields: `path=value`, `path==value` or `path!=value`, comma separated, `path` a dotted field
  (`metadata.name`, `spec.nodeName`, `involvedObject.name`); a missing field reads as "".
  ValueError for a term that is none of those.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spotguard.kube.api import matches_labels


def field_terms(selector: str | None) -> list[tuple[str, str, bool]]:
    """(dotted path, value, equal) per term of `selector`; [] for none."""
    terms = []
    for raw in (selector or "").split(","):
        term = raw.strip()
        if not term:
            continue
        if "!=" in term:
            path, _, value = term.partition("!=")
            terms.append((path.strip(), value.strip(), False))
        elif "=" in term:
            path, _, value = term.partition("=")
            terms.append((path.strip(), value.lstrip("=").strip(), True))
        else:
            raise ValueError(f"field selector term {term!r}: expected path=value or path!=value")
    return terms


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """The field at dotted `path` as text ("" when missing)."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return "" if value is None else str(value)


def matches(obj: Mapping[str, Any], labels: Mapping[str, str] | None,
            fields: list[tuple[str, str, bool]]) -> bool:
    """Whether `obj` matches both selectors."""
    if labels and not matches_labels(obj, labels):
        return False
    return all((field_value(obj, path) == value) == equal for path, value, equal in fields)
