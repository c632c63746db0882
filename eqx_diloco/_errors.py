"""Errors a user can cause, as opposed to bugs."""


class ConfigError(ValueError):
    """A user-facing configuration mistake. Its message is one line naming the flag (or argument) and the rule."""


class NonFiniteError(RuntimeError):
    """A replica produced a NaN/Inf loss or outer gradient under the `stop` non-finite policy."""
