"""`python -m eqx_diloco.train`: the command-line trainer.

Examples:

    python -m eqx_diloco.train                                   # DiLoCo, 2 replicas, embedded corpus
    python -m eqx_diloco.train --diloco.num-fragments 4          # Streaming DiLoCo
    python -m eqx_diloco.train --algorithm ddp                   # data-parallel baseline
"""

import sys

import tyro

from .config import Config, ConfigError, validate
from .mesh import setup_devices


def main(argv: list[str] | None = None) -> int:
    config = tyro.cli(Config, args=argv)
    try:
        validate(config)
        setup_devices(config)
        from .trainer import NonFiniteError, train  # imported after the device count is set

        try:
            train(config)
        except NonFiniteError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
