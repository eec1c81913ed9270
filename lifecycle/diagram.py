"""The state diagram, drawn by `transitions` itself from the same table the machine runs.

>>> print(mermaid().splitlines()[3])
stateDiagram-v2
"""

from __future__ import annotations

from transitions.extensions import GraphMachine

from .states import INITIAL_STATE, TRANSITIONS, LifecycleState


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
