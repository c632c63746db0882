"""`python -m eqx_diloco.prepare`: tokenize text into a token file (`eqx_diloco.lm.prepare`).

An entry point of the application tier, kept at this path so the command stays short; importing
it does nothing."""

if __name__ == "__main__":
    import sys

    from eqx_diloco.lm.prepare import main

    sys.exit(main())
