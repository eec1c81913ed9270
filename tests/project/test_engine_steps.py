"""`benchmarks.engine_steps.Steps`, on a clock the test drives: a step's exclusive time, the timers' own cost
charged to neither the step nor its caller, and the probe that measures that cost where the timers run."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.engine_steps import PROBE, Steps

READ = 1.0  # what each reading of the clock costs: its timer's code between two steps, inside or outside


class Clock:
    """Reads `now`, then advances it by READ (the timer's work after taking a reading); `spend` advances it by a
    step's own work."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        t = self.now
        self.now += READ
        return t

    def spend(self, seconds: float) -> None:
        self.now += seconds


def timed_call_tree(steps: Steps, clock: Clock) -> Callable[[], None]:
    """A parent step that spends 2 itself and calls a child step twice; the child spends 5 per call."""

    def child() -> None:
        clock.spend(5.0)

    timed_child = steps.wrap("child", child)

    def parent() -> None:
        clock.spend(2.0)
        timed_child()
        timed_child()

    return steps.wrap("parent", parent)


def test_a_childs_timer_cost_lands_in_its_callers_time_unless_its_probe_measured_it():
    # uncorrected: each child's reading after its window (READ) is counted in the parent's own time
    clock = Clock()
    plain = Steps(clock=clock, outside_s=0.0, probe_inside_s=0.0)
    timed_call_tree(plain, clock)()
    assert plain.calls == {"parent": 1, "child": 2}
    assert plain.seconds["child"] == 2 * (5.0 + READ)  # its work and the reading that opened its window
    assert plain.seconds["parent"] == 2.0 + READ + 2 * READ  # its work, its own reading, its children's timers

    # probed: a probe around each timer; its time per call is what that timer cost the caller, plus the probe's
    # own reading inside its window (the hot calibration given here: READ)
    clock = Clock()
    probed = Steps(probe=True, clock=clock, outside_s=0.0, probe_inside_s=READ)
    timed_call_tree(probed, clock)()
    assert probed.seconds[PROBE + "child"] == 2 * (READ + READ)
    excess = probed.excess_per_call()
    assert excess == {"child": READ, "parent": READ}
    assert set(probed.step_seconds()) == {"parent", "child"}

    # corrected with what the probe measured: the parent holds its own work and its own reading, nothing else
    clock = Clock()
    corrected = Steps(excess=excess, clock=clock, outside_s=0.0, probe_inside_s=READ)
    timed_call_tree(corrected, clock)()
    assert corrected.seconds["parent"] == 2.0 + READ
    assert corrected.seconds["child"] == plain.seconds["child"]


def test_the_hot_calibration_is_small_and_never_negative():
    steps = Steps()
    assert 0.0 <= steps.outside_s < 1e-3
    assert steps.excess_per_call() == {}  # nothing timed, nothing probed
