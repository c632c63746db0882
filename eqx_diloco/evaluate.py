"""`python -m eqx_diloco.evaluate MODEL`: held-out loss and multiple-choice accuracy (`eqx_diloco.lm.evaluate`).

An entry point of the application tier, kept at this path so the command stays short; importing
it does nothing."""

if __name__ == "__main__":
    import sys

    from eqx_diloco.lm.evaluate import main

    sys.exit(main())
