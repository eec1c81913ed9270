"""The state diagram from the same table the machine runs: mermaid (drawn by `transitions` itself) or DOT.

>>> print(mermaid().splitlines()[3])
stateDiagram-v2
>>> print(dot().splitlines()[0])
digraph reload_lifecycle {
"""

from __future__ import annotations

from transitions.extensions import GraphMachine

from ..states import INITIAL_STATE, TRANSITIONS, LifecycleState

__all__ = ["FORMATS", "dot", "mermaid", "render"]

FORMATS = ("mermaid", "dot")


class _Model:
    state: LifecycleState


def mermaid(current: LifecycleState | str | None = None, title: str = "draft backbone reload lifecycle") -> str:
    """Mermaid `stateDiagram-v2` text (no binaries needed). Conditions show as `[condition]`; `current`, if
    given, is drawn as the active state."""
    model = _Model()
    rows = [
        {
            "trigger": t.trigger,
            "source": list(t.sources),
            "dest": t.dest,
            "conditions": [t.condition] if t.condition else [],
        }
        for t in TRANSITIONS
    ]
    machine = GraphMachine(model=model, states=LifecycleState, transitions=rows, initial=INITIAL_STATE,
                           auto_transitions=False, graph_engine="mermaid", title=title, show_conditions=True)
    if current is not None:
        machine.set_state(LifecycleState(current), model)
    return model.get_graph(force_new=True).draw(None)  # type: ignore[attr-defined]


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def dot(current: LifecycleState | str | None = None, title: str = "draft backbone reload lifecycle") -> str:
    """Graphviz DOT text, one edge per (row, source) of the table labelled `trigger [condition]`; `current`,
    if given, is filled. Written here from the table (no graphviz needed to produce it)."""
    active = LifecycleState(current) if current is not None else None
    lines = [
        "digraph reload_lifecycle {",
        f"  label={_dot_quote(title)}; labelloc=t; rankdir=LR;",
        '  node [shape=box, style="rounded,filled", fillcolor=white, fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10];',
        "  __start [shape=point, label=\"\"];",
        f"  __start -> {INITIAL_STATE.value};",
    ]
    for state in LifecycleState:
        attrs = [f"label={_dot_quote(state.value)}"]
        if state is active:
            attrs += ['fillcolor="#ffd54f"', "penwidth=2"]
        lines.append(f"  {state.value} [{', '.join(attrs)}];")
    for t in TRANSITIONS:
        label = t.trigger + (f" [{t.condition}]" if t.condition else "")
        for src in t.sources:
            lines.append(f"  {src.value} -> {t.dest.value} [label={_dot_quote(label)}];")
    lines.append("}")
    return "\n".join(lines)


def render(fmt: str = "mermaid", current: LifecycleState | str | None = None) -> str:
    """The diagram in one of `FORMATS`."""
    if fmt == "mermaid":
        return mermaid(current)
    if fmt == "dot":
        return dot(current)
    raise ValueError(f"unknown diagram format {fmt!r}; known: {', '.join(FORMATS)}")
