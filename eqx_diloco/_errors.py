"""Errors a user can cause, as opposed to bugs."""


class ConfigError(ValueError):
    """A user-facing configuration mistake. Its message is one line naming the flag (or argument) and the rule."""


class NonFiniteError(RuntimeError):
    """A replica produced a NaN/Inf loss or outer gradient under the `stop` non-finite policy.

    `state`: the state the raising call had reached (the state passed to it was donated), or
    None. A non-finite outer step is never applied, so its global model is the last finite one:
    `diloco.global_model(error.state)` reads it, `diloco.save(ckpt, error.state, force=True)`
    keeps it (its replicas may hold the non-finite values).
    """

    def __init__(self, message: str, *, state=None):
        super().__init__(message)
        self.state = state
