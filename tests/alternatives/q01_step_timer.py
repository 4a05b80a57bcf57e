import time


def time_step(step, sync, clock=time.perf_counter):
    """Seconds that one call of step() takes on the device (not just its launch)."""
    marks = []
    for action in (sync, lambda: marks.append(clock()), step, sync, lambda: marks.append(clock())):
        action()
    first, last = marks
    return last - first
