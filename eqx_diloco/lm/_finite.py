"""The trainer's non-finite checks, under `--train.on-nonfinite`: `stop` raises at the first
non-finite value, `skip` drops the replicas that have one until none is left. A non-finite global
model stops the run under either policy."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._errors import NonFiniteError
from .._rare_programs import options_key
from .._replica_values import replicated_value


def _all_finite(tree) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.array(True)


def finite_check(options: dict | None = None):
    """`all_finite` as a program compiled with XLA `options` (the trainer gives it the sync programs': it
    runs once a sync)."""
    return _checker(options_key(options))


@functools.cache
def _checker(options: tuple):
    return jax.jit(_all_finite, compiler_options=dict(options) or None)


def all_finite(tree) -> jax.Array:
    """Whether every float leaf of `tree` is finite (one boolean scalar, computed where the arrays live)."""
    return finite_check()(tree)


@dataclasses.dataclass(frozen=True)
class FiniteChecks:
    """The checks of one run; `policy` is `--train.on-nonfinite` ("stop" or "skip")."""

    policy: str

    def check(self, t: int, what: str, values: np.ndarray) -> list[int]:
        """The replicas whose `what` (one flag per replica) is non-finite at step `t`; `stop` raises on any."""
        bad = [r for r, ok in enumerate(values) if not ok]
        if bad and self.policy == "stop":
            raise NonFiniteError(
                f"non-finite {what} in replica {bad[0]} at step {t} (--train.on-nonfinite stop; "
                f"use skip to drop that replica's contribution; a checkpoint saved since the run diverged "
                f"stops here again: resume an earlier one with --checkpoint.restore-step and a lower --train.lr)"
            )
        return bad

    def all_skipped(self, t: int, what: str) -> NonFiniteError:
        """The error for `skip` with every replica dropped."""
        return NonFiniteError(
            f"non-finite {what} in every replica at step {t}: --train.on-nonfinite skip has nothing left to "
            f"train on (lower --train.lr or --diloco.outer-lr, or resume an earlier checkpoint with "
            f"--checkpoint.restore-step)"
        )

    def check_sync(self, t: int, values: np.ndarray) -> list[int]:
        """Finite flags of a finished sync: `stop` raises on any, `skip` when all replicas are out."""
        bad = self.check(t, "outer gradient", values)
        if bad and len(bad) == len(values):
            raise self.all_skipped(t, "outer gradient")
        return bad

    def check_global(self, t: int, flag: jax.Array | bool | None) -> None:
        """Stop (under either policy) if the global model is non-finite after an outer step."""
        if flag is not None and not (flag if isinstance(flag, bool) else bool(replicated_value(flag))):
            raise NonFiniteError(
                f"the global model is non-finite after the outer step at step {t} (--train.on-nonfinite "
                f"{self.policy}); lower --diloco.outer-lr or --train.lr, or resume an earlier "
                f"checkpoint with --checkpoint.restore-step"
            )

    def check_eval(self, t: int, value: float) -> None:
        """Stop (under either policy) if the global model's eval loss is non-finite."""
        if not np.isfinite(value):
            raise NonFiniteError(
                f"the global model's eval loss is non-finite at step {t} (--train.on-nonfinite "
                f"{self.policy}); lower --train.lr or --diloco.outer-lr, or resume an earlier "
                f"checkpoint with --checkpoint.restore-step"
            )
