"""`python -m eqx_diloco.export`: export a run's global model (`eqx_diloco.lm.export`).

An entry point of the application tier, kept at this path so the command stays short; importing
it does nothing."""

if __name__ == "__main__":
    import sys

    from eqx_diloco.lm.export import main

    sys.exit(main())
