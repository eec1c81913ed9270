"""Bounding audit events: every field cut to a fixed size, with counts of what was cut, and no tensor values.

Every event is bounded before it is written or kept (`lifecycle.events` bounds what it is sent; a lifecycle bounds
the record it keeps in `recent_events`): at most `LIST_CAP` items in a list of names (the rest counted in
`<field>_more`), at most `STR_CAP` characters in a string (the cut counted in `<field>_truncated`), an integer of
more than `INT_BITS_CAP` bits as its size, and a tensor that slipped into a field as its description, never its
values:

>>> import torch
>>> ev = bound_event(None, "info", {"names": [f"t{i}" for i in range(20)], "reason": "x" * 5000,
...                                 "oops": torch.ones(3), "huge": 10 ** 5000})
>>> len(ev["names"]), ev["names_more"], len(ev["reason"]), ev["reason_truncated"], ev["oops"], ev["huge"]
(16, 4, 4096, 904, '<tensor shape=(3,) dtype=torch.float32 device=cpu>', '<int of 16610 bits>')
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

__all__ = ["DEPTH_CAP", "INT_BITS_CAP", "LIST_CAP", "RECORDS_CAP", "STR_CAP", "bound_event", "bound_fields"]

#: At most this many names in a list field; the rest are counted in `<field>_more`.
LIST_CAP = 16
#: At most this many records (dicts) in a list field, such as the per-buffer records of a `refresh` event, and
#: at most this many keys in a mapping field.
RECORDS_CAP = 256
#: At most this many characters in a string field; the number cut is `<field>_truncated`.
STR_CAP = 4096
#: An integer wider than this is written as `<int of N bits>` (Python refuses to print one of over 4,300 digits).
INT_BITS_CAP = 64
#: Nesting deeper than this (lists in dicts in lists ...) is written as a description.
DEPTH_CAP = 4


def _describe_tensor(value: Any) -> str | None:
    """A tensor (or anything tensor-like from torch/numpy) as its description; None for anything else."""
    module = type(value).__module__
    if not module.startswith(("torch", "numpy")) or not hasattr(value, "shape") or not hasattr(value, "dtype"):
        return None
    device = getattr(value, "device", "cpu")
    return f"<tensor shape={tuple(value.shape)} dtype={value.dtype} device={device}>"


def _bound_value(key: str, value: Any, out: MutableMapping[str, Any], depth: int = 0) -> Any:
    kind = type(value)
    if kind is int:
        return value if value.bit_length() <= INT_BITS_CAP else f"<int of {value.bit_length()} bits>"
    if kind is bool or kind is float or value is None:
        return value
    if kind is str:
        if len(value) > STR_CAP:
            out[f"{key}_truncated"] = len(value) - STR_CAP
            return value[:STR_CAP]
        return value
    if isinstance(value, (dict, list, tuple)) and depth >= DEPTH_CAP:
        return f"<{kind.__name__} nested deeper than {DEPTH_CAP}>"
    if isinstance(value, dict):
        inner: dict[str, Any] = {}
        items = list(value.items())
        if len(items) > RECORDS_CAP:
            out[f"{key}_more"] = out.get(f"{key}_more", 0) + len(items) - RECORDS_CAP
            items = items[:RECORDS_CAP]
        for k, v in items:
            vkind = type(v)  # a plain value kept as it is, decided inline (a refresh's per-buffer records)
            if (vkind is str and len(v) <= STR_CAP) or vkind is bool or vkind is float or v is None \
                    or (vkind is int and -_INT_BOUND < v < _INT_BOUND):
                inner[k] = v
            else:
                inner[k] = _bound_value(str(k), v, inner, depth + 1)
        return inner
    if isinstance(value, (list, tuple)):
        records = any(isinstance(v, dict) for v in value)
        cap = RECORDS_CAP if records else LIST_CAP
        if len(value) > cap:
            out[f"{key}_more"] = out.get(f"{key}_more", 0) + len(value) - cap
            value = value[:cap]
        bounded: list[Any] = []
        for v in value:
            cut: dict[str, Any] = {}  # what bounding the item cut (dropped: a list item has no fields beside it)
            bounded.append(_bound_value(key, v, cut, depth + 1))
        return bounded
    if isinstance(value, (bool, int, float, str)):  # a subclass (an enum, a numpy scalar): its plain value
        plain = next(t for t in (bool, int, float, str) if isinstance(value, t))
        return _bound_value(key, plain.__str__(value) if plain is str else plain(value), out, depth)
    described = _describe_tensor(value)
    if described is not None:
        return described
    return _bound_value(key, str(value), out, depth)


def bound_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A bounded copy of an event's fields (see the module doc); what is written and what lifecycles keep."""
    out = dict(fields)
    bound_event(None, "", out)
    return out


_INT_BOUND = 2 ** INT_BITS_CAP  # |value| < this: at most INT_BITS_CAP bits


def bound_event(_logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Processor: bounded size, no tensor values (see the module doc)."""
    slow = None
    for key, value in event_dict.items():  # the common values decided inline: this runs for every event
        kind = type(value)
        if (kind is str and len(value) <= STR_CAP) or kind is bool or kind is float or value is None \
                or (kind is int and -_INT_BOUND < value < _INT_BOUND):
            continue
        if slow is None:
            slow = []
        slow.append(key)
    if slow is None:
        return event_dict
    extra: dict[str, Any] = {}
    for key in slow:
        event_dict[key] = _bound_value(key, event_dict[key], extra)
    for key, value in extra.items():  # a count the caller already gave is added to, not replaced
        given = event_dict.get(key, 0)
        event_dict[key] = value + given if key.endswith("_more") and type(given) is int else value
    return event_dict
