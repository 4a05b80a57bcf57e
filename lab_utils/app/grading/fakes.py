"""Stand-ins that let an exercise be checked on any laptop (no GPU, no cluster)."""

from __future__ import annotations


class FakeAsyncDevice:
    """A pretend GPU with a controllable clock, to test a step timer on the CPU.

    Like CUDA, a step *launches* its work and returns after ``launch_seconds`` of host time; the work
    runs later, one kernel after another. ``sync()`` waits until all queued work is done
    (``torch.cuda.synchronize()``); ``clock()`` reads the host clock (``time.perf_counter()``).
    ``queued_seconds`` is work still running from before the step (the previous step, a copy). A
    timer that does not synchronize measures the launch only, or bills that earlier work to the step;
    the right answer is ``launch_seconds + work_seconds``.
    """

    def __init__(self, queued_seconds: float = 0.0, launch_seconds: float = 1e-4):
        self.now = 0.0
        self.busy_until = float(queued_seconds)
        self.launch_seconds = float(launch_seconds)
        self.work_seconds = 0.0
        self.steps = 0

    def clock(self) -> float:
        """The host clock, in seconds."""
        return self.now

    def sync(self) -> None:
        """Wait until every queued piece of work has finished."""
        self.now = max(self.now, self.busy_until)

    def step_fn(self, work_seconds: float):
        """A step that queues ``work_seconds`` of device work and returns after the launch."""
        self.work_seconds = float(work_seconds)

        def step():
            self.steps += 1
            self.now += self.launch_seconds
            self.busy_until = max(self.busy_until, self.now) + self.work_seconds

        return step
