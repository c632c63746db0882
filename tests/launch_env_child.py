"""A stand-in trainer (`--module launch_env_child`) that prints, on stderr, the variable through which the
launcher tells its processes about `--bandwidth` (the trainer's setup lines show it) the CPUs it may run on,
and those it may compile on before its first step."""

import os
import sys

print(f"link={os.environ.get('EQX_DILOCO_LINK_LIMIT')}", file=sys.stderr)
print(f"compile_cpus={os.environ.get('EQX_DILOCO_COMPILE_CPUS')}", file=sys.stderr)
if hasattr(os, "sched_getaffinity"):
    print(f"cpus={','.join(map(str, sorted(os.sched_getaffinity(0))))}", file=sys.stderr)
