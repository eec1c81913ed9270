"""HTML (and inline SVG) written one way: a constant template, and every value escaped on its way in.

The report shows values read from logs that come from many machines; one unescaped field is stored XSS. So no
HTML is built with f-strings (a test checks the modules that write it): `html(template, ...)` fills a constant
`str.format` template and escapes every value (`html.escape`, quotes included) unless it is `Markup`, which only
`html`, `join` and `trusted` (for the package's own assets) make. Numbers are formatted only after a type check
(`number`): a value that is not a finite int or float is shown as "?".

>>> html('<td class="{cls}">{text}</td>', cls='x" onmouseover="alert(1)', text="<script>")
'<td class="x&quot; onmouseover=&quot;alert(1)">&lt;script&gt;</td>'
>>> html("{n:.1f} ms", n=number("1e3; <b>")), html("{n:.1f} ms", n=number(2.25))
('? ms', '2.2 ms')
"""

from __future__ import annotations

import html as _html
import math
import string
from collections.abc import Iterable
from typing import Any

__all__ = ["Markup", "html", "join", "number", "trusted"]


class Markup(str):
    """Text that is HTML already: made by `html`, `join` or `trusted`, inserted as it is."""

    __slots__ = ()


class _Unknown(str):
    """A number that failed its type check: shown as "?" whatever the format spec."""

    __slots__ = ()


class _EscapingFormatter(string.Formatter):
    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, Markup):
            if format_spec:
                raise ValueError("a format spec applies to values, not to Markup")
            return value
        if isinstance(value, _Unknown):
            return "?"
        return _html.escape(format(value, format_spec), quote=True)


_FORMATTER = _EscapingFormatter()


def html(template: str, /, *args: Any, **values: Any) -> Markup:
    """`template` (a constant of the calling module, `str.format` syntax) filled with `args`/`values`, each
    escaped unless it is `Markup`."""
    return Markup(_FORMATTER.vformat(template, args, values))


def join(parts: Iterable[Markup], separator: str = "") -> Markup:
    """Markup pieces joined; a piece that is not `Markup` is escaped."""
    return Markup(_html.escape(separator).join(p if isinstance(p, Markup) else _html.escape(str(p)) for p in parts))


def trusted(text: str) -> Markup:
    """The package's own HTML, CSS or script (its assets, generated from constants): inserted as it is. Never for
    a value that came from a log."""
    return Markup(text)


def number(value: Any) -> Any:
    """`value` if it is a finite int or float (not a bool), else a placeholder every format spec shows as "?"."""
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return value
    return _Unknown("?")
