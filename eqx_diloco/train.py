"""`python -m eqx_diloco.train`: the LM trainer (`eqx_diloco.lm.train`).

An entry point of the application tier, kept at this path so the command stays short; importing
it does nothing."""

if __name__ == "__main__":
    from eqx_diloco.lm.train import entry

    entry()
