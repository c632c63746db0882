"""The harness every benchmark script shares, as one import (`from benchmarks import
_common as common`): device set-up and provenance, running the trainer, statistics,
tables, JSON and plots. Each concept lives in its own module under `benchmarks/_harness`.

Nothing here touches JAX devices at import time, so a benchmark's `main` can still call
`setup_jax` (which sets the simulated CPU device count) before anything else does.
"""

from benchmarks._harness.environment import (  # noqa: F401
    REPO,
    RESULTS_DIR,
    add_mode_flags,
    default_out_dir,
    machine_info,
    revision,
    setup_jax,
)
from benchmarks._harness.output import fmt_bytes, jsonable, markdown_table, write_json, write_text  # noqa: F401
from benchmarks._harness.plots import plot_curves  # noqa: F401
from benchmarks._harness.runs import (  # noqa: F401
    TemporaryRunDirs,
    average_seeds,
    read_metrics,
    small_lm_config,
    summarize_run,
    train_and_summarize,
)
from benchmarks._harness.stats import fmt_pm, mean_sd, paired_gap  # noqa: F401
