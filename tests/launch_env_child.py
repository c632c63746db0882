"""A stand-in trainer (`--module launch_env_child`) that prints, on stderr, the variable through which the
launcher tells its processes about `--bandwidth` (the trainer's setup lines show it)."""

import os
import sys

print(f"link={os.environ.get('EQX_DILOCO_LINK_LIMIT')}", file=sys.stderr)
