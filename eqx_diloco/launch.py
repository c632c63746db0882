"""`python -m eqx_diloco.launch`: N local trainer processes (`eqx_diloco.lm.launch`).

An entry point of the application tier, kept at this path so the command stays short; importing
it does nothing."""

if __name__ == "__main__":
    import sys

    from eqx_diloco.lm.launch import main

    sys.exit(main())
