"""`python -m eqx_diloco.train` whose metrics.jsonl or TensorBoard file fills the disk: run as
`python -m full_disk_child FLAGS` (or `launch --module full_disk_child`) with `tests/` on PYTHONPATH.

`$FULL_DISK_LOG` names the log that fails (`metrics` or `tensorboard`); its write after
`$FULL_DISK_AFTER` successful ones raises ENOSPC, as a full disk does. The run then leaves
through the CLI's own `entry()`, the way a real command does (its exit sequence included).
"""

import errno
import os
import sys

from eqx_diloco.lm._tensorboard import TensorBoardLog
from eqx_diloco.lm.metrics import MetricsLog
from eqx_diloco.lm.train import entry


class FullDisk:
    """A log's file object whose writes fail with ENOSPC once `writes_left` went through."""

    def __init__(self, file, writes_left: int):
        self.file, self.writes_left = file, writes_left

    def fileno(self):
        return self.file.fileno()

    def write(self, data):
        if self.writes_left == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.writes_left -= 1
        return self.file.write(data)

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()


def fill_disk_under(log_class, writes_left: int) -> None:
    original = log_class.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.enabled:
            self._file = FullDisk(self._file, writes_left)

    log_class.__init__ = init


if __name__ == "__main__":
    fill_disk_under(MetricsLog if os.environ["FULL_DISK_LOG"] == "metrics" else TensorBoardLog,
                    int(os.environ["FULL_DISK_AFTER"]))
    sys.argv[0] = "python -m eqx_diloco.train"
    entry()
