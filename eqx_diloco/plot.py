"""`python -m eqx_diloco.plot`: loss curves of runs (`eqx_diloco.lm.plot`).

An entry point of the application tier, kept at this path so the command stays short; importing
it does nothing."""

if __name__ == "__main__":
    import sys

    from eqx_diloco.lm.plot import main

    sys.exit(main())
