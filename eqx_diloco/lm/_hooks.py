"""What the trainer's loop does on a schedule, besides training: a `Hook` runs after step t every
`every` steps, after the last step, and (if `on_stop`) at the step a stop signal was agreed on."""

import dataclasses
from collections.abc import Callable

from .._state import TrainState


@dataclasses.dataclass(frozen=True)
class Hook:
    """One scheduled action of the loop.

    - `name`: what it does, for a reader (`"evaluate"`, `"checkpoint"`).
    - `every`: steps between calls; 0 runs it on schedule never.
    - `fn`: `(state, t) -> state`, called after step `t` (with every sync of it settled).
    - `at_end`: also after the last step.
    - `on_stop`: also at the step the run stops on SIGTERM / SIGHUP.
    - `when`: also after any step for which this says so (a schedule by time); None: steps only.
    """

    name: str
    every: int
    fn: Callable[[TrainState, int], TrainState]
    at_end: bool = True
    on_stop: bool = False
    when: Callable[[], bool] | None = None

    def due(self, t: int, *, final: bool, stop: bool) -> bool:
        """Whether the hook runs after step `t` (`final`: the last step; `stop`: the run stops there)."""
        return ((self.every > 0 and t % self.every == 0) or (final and self.at_end) or (stop and self.on_stop)
                or (self.when is not None and self.when()))
