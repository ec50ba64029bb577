"""How busy each pipeline stage is: sampled windows of steps, timed by events around each stage's work, read only
once they have happened."""

from devmap.generation.busy import BusyClock


class Clock:
    """Events on a fake GPU timeline: each records the time now; `now` moves as the test says."""

    def __init__(self) -> None:
        self.now, self.done = 0.0, True

    def event(self):
        clock = self

        class Event:
            def record(self, stream) -> None:
                self.at = clock.now

            def query(self) -> bool:
                return clock.done

            def elapsed_time(self, other) -> float:
                return (other.at - self.at) * 1000

        return Event()


def test_a_stage_that_waits_for_the_other_is_half_busy_and_unfinished_windows_wait():
    clock = Clock()
    busy = BusyClock(2, event=clock.event, every=4, window=2)
    for step in range(1, 5):
        busy.begin_step(step)
        for stage in (0, 1):  # stage 0 works 1 s, then stage 1 works 1 s: each idle while the other works
            with busy.around(stage, stream="s"):
                clock.now += 1.0
    clock.done = False
    busy.begin_step(5)  # a new window starts: the first one (steps 1 and 2) is complete
    assert busy.harvest() == []  # its events have not all happened yet: nothing read, nothing lost
    clock.done = True
    got = busy.harvest()
    assert [(stage, round(b, 6), round(s, 6)) for stage, b, s in got] == [(0, 2.0, 3.0), (1, 2.0, 3.0)]
    assert busy.harvest() == []  # read once


def test_steps_outside_the_windows_and_cpu_work_are_not_timed():
    clock = Clock()
    busy = BusyClock(1, event=clock.event, every=4, window=1)
    busy.begin_step(2)  # not in a window
    with busy.around(0, stream="s"):
        clock.now += 1.0
    busy.begin_step(5)
    with busy.around(0, stream=None):  # a CPU stage
        clock.now += 1.0
    busy.begin_step(9)
    assert busy.harvest() == []
