"""`python -m eqx_diloco.sample`: generate text from an exported model (`eqx_diloco.lm.sample`).

An entry point of the application tier, kept at this path so the command stays short; importing
it does nothing."""

if __name__ == "__main__":
    import sys

    from eqx_diloco.lm.sample import main

    sys.exit(main())
