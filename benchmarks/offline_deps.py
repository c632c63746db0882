"""Copy the Python packages a benchmark imports, from this environment into a folder, for a machine that
has JAX but cannot install anything (an accelerator host without a network), with their metadata:

    python -m benchmarks.offline_deps runs/tpu_deps                 # here, once
    PYTHONPATH=$PWD:$PWD/runs/tpu_deps:$PYTHONPATH python -m benchmarks.gpu ...   # there

Which packages: every top-level module outside the standard library that importing the trainer and
`benchmarks.gpu` loads, except those the other machine has already (`--have`, default JAX's own:
jax, jaxlib, numpy, ml_dtypes, opt_einsum, scipy). Pure-Python packages only travel this way; the
folder works with the same Python minor version."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

from benchmarks._common import REPO

IMPORTS = "import eqx_diloco.lm.trainer, benchmarks.gpu, benchmarks._throughput.plain_loop"
HAVE = "jax,jaxlib,numpy,ml_dtypes,opt_einsum,scipy"
OURS = {"eqx_diloco", "models", "benchmarks"}


def imported_packages() -> list[str]:
    """Top-level modules outside the standard library that `IMPORTS` loads (in a fresh interpreter)."""
    listing = (f"import sys; {IMPORTS}; import json; print(json.dumps(sorted({{m.split('.')[0] for m in "
               f"sys.modules}} - set(sys.stdlib_module_names))))")
    out = subprocess.run([sys.executable, "-c", listing], cwd=REPO, capture_output=True, text=True, check=True)
    return [name for name in json.loads(out.stdout.strip().splitlines()[-1])
            if not name.startswith("_") and name not in OURS]


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    parser.add_argument("--have", default=HAVE, help="comma-separated modules the other machine has")
    args = parser.parse_args(argv)
    have = set(args.have.split(","))
    args.folder.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in imported_packages():
        try:
            spec = importlib.util.find_spec(name)
        except ValueError:  # a module made at run time (cython_runtime): nothing on disk to copy
            continue
        if name in have or spec is None or spec.origin in (None, "built-in", "frozen"):
            continue
        source = pathlib.Path(spec.origin)
        if source.name == "__init__.py":  # a package: its folder
            shutil.copytree(source.parent, args.folder / name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, args.folder / source.name)
        for distribution in importlib.metadata.packages_distributions().get(name, []):  # versions some read at import
            info = pathlib.Path(importlib.metadata.distribution(distribution)._path)
            if info.is_dir():
                shutil.copytree(info, args.folder / info.name, dirs_exist_ok=True)
        copied.append(name)
    print(f"copied {', '.join(copied)} into {args.folder}", flush=True)
    return copied


if __name__ == "__main__":
    main()
