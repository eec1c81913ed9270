"""HTML (and inline SVG) written one way: a constant template, and every value escaped on its way in.

The report shows values read from logs that come from many machines; one unescaped field is stored XSS. So no
HTML is built with f-strings (a test checks the modules that write it), and MarkupSafe does the escaping: a
template is a `Markup` constant of its module, `TEMPLATE.format(text=value)` fills it and escapes every value
(quotes included) unless it is `Markup` already, and `Markup(separator).join(parts)` escapes every part that is
not. Only the package's own constants and assets become `Markup` directly. What this module adds is the one
rule MarkupSafe has no word for: numbers are formatted only after a type check (`number`), so a value that is
not a finite int or float (a string in a number's field, say) is shown as "?" whatever the format spec.

>>> from markupsafe import Markup
>>> Markup('<td class="{cls}">{text}</td>').format(cls='x" onmouseover="alert(1)', text="<script>")
Markup('<td class="x&#34; onmouseover=&#34;alert(1)">&lt;script&gt;</td>')
>>> Markup("{n:.1f} ms").format(n=number("1e3; <b>")), Markup("{n:.1f} ms").format(n=number(2.25))
(Markup('? ms'), Markup('2.2 ms'))
"""

from __future__ import annotations

import math

from markupsafe import Markup

__all__ = ["number"]


class _Unknown:
    """A number that failed its type check: "?" in a template whatever the format spec."""

    __slots__ = ()

    def __html_format__(self, format_spec: str, /) -> Markup:
        return Markup("?")

    def __str__(self) -> str:
        return "?"


_UNKNOWN = _Unknown()


def number(value: object) -> object:
    """`value` if it is a finite int or float (not a bool), else a placeholder every format spec shows as "?"."""
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return value
    return _UNKNOWN
