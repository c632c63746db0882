"""What the trainer's non-finite stops tell the user to do."""

import numpy as np
import pytest

from eqx_diloco import NonFiniteError
from eqx_diloco.lm._finite import FiniteChecks


@pytest.mark.parametrize("what", ["loss", "outer gradient"])
def test_a_stop_on_one_replica_names_the_way_back(what):
    """N3: a resume from a checkpoint saved after the run diverged (finite, but far off) stops at the same
    step again; the line has to say how to go back further, as the other non-finite stops do."""
    with pytest.raises(NonFiniteError) as error:
        FiniteChecks("stop").check(5, what, np.array([True, False]))
    assert str(error.value) == (
        f"non-finite {what} in replica 1 at step 5 (--train.on-nonfinite stop; use skip to drop that replica's "
        f"contribution; a checkpoint saved since the run diverged stops here again: resume an earlier one with "
        f"--checkpoint.restore-step and a lower --train.lr)")
