"""Where a benchmark runs and writes: simulated CPU devices, the mode flags, the default
output folder, and the provenance recorded in every artifact (git revision, machine).

Nothing here touches JAX devices at import time, so a benchmark's `main` can still call
`setup_jax` (which sets the simulated CPU device count) before anything else does.
"""

from __future__ import annotations

import os
import pathlib
import platform
import subprocess
from typing import Any

RESULTS_DIR = pathlib.Path(__file__).resolve().parents[1] / "results"
REPO = RESULTS_DIR.parents[1]


def default_out_dir(name: str, mode: str) -> pathlib.Path:
    """Where a benchmark writes when no output folder is given: `runs/benchmarks/<name>_<mode>`
    (not committed). Committed results under `benchmarks/results` are only written when a
    script is given that folder explicitly (`--out-dir benchmarks/results`)."""
    return REPO / "runs" / "benchmarks" / f"{name}_{mode}"


def setup_jax(num_devices: int, *, compile_cache: str | os.PathLike | None = None) -> None:
    """Ask for `num_devices` simulated CPU devices (before JAX starts its backend) and
    optionally turn on JAX's persistent compilation cache in `compile_cache`.

    The cache only saves compile time: runs of a benchmark that build identical programs
    (same shapes, same sync functions) compile once. It never changes results.
    """
    from eqx_diloco._mesh import ensure_cpu_devices

    ensure_cpu_devices(num_devices)
    if compile_cache is not None:
        import jax

        pathlib.Path(compile_cache).mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(compile_cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def add_mode_flags(parser) -> None:
    """--quick (the default) / --full / --smoke, stored in `args.mode`."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", dest="mode", action="store_const", const="quick", help="the default")
    group.add_argument("--full", dest="mode", action="store_const", const="full")
    group.add_argument("--smoke", dest="mode", action="store_const", const="smoke", help="tests only")


# Changes that cannot move a result: what benchmarks write, and prose.
_NOT_INPUTS = [":(exclude)benchmarks/results", ":(exclude)docs", ":(exclude)*.md"]


def revision() -> str | None:
    """The git commit of the code that ran (with `-dirty` for local changes to anything but results
    and prose), if known."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10,
                             check=False)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", *_NOT_INPUTS],
                               cwd=REPO, capture_output=True, text=True, timeout=10, check=False)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def machine_info() -> dict[str, Any]:
    import jax

    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "cpu_count": os.cpu_count(),
        # Not platform.platform(): it starts `uname -p` in a subprocess.
        "platform": "-".join(os.uname()[i] for i in (0, 2, 4)),
        "python": platform.python_version(),
    }
