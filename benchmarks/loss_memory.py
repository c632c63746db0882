"""Temporaries of the training step's loss: logsumexp minus the target's logit (the model's loss) against
the float32 log-softmax + `take_along_axis` it replaced, from the compiler's `memory_analysis()`.

Compiles `value_and_grad` of the whole model's loss ahead of time on abstract inputs (nothing is
allocated or run) at 12 layers x 768, vocab 32768, T = 1024, bfloat16 compute, the stack unrolled
(as on an accelerator), for each formula, and reports the temporaries XLA's CPU compiler plans.
A GPU or TPU compiler plans its own buffers, so the figures are a CPU compile's; the difference
between the two formulas is the (B, T, vocab) float32 array the old one kept.

    python -m benchmarks.loss_memory --out-dir benchmarks/results   # about 3 minutes on 2 cores
    python -m benchmarks.loss_memory --smoke                        # a tiny shape: checks the script

Writes `loss_memory.json` and `loss_memory.md` in `--out-dir` (default `runs/benchmarks/loss_memory_<mode>`).
"""

from __future__ import annotations

import argparse
import pathlib
import time

from benchmarks import _common as common

SHAPES = {
    "quick": dict(layers=12, dim=768, heads=12, vocab=32768, seq=1024, batch=8),
    "smoke": dict(layers=2, dim=64, heads=4, vocab=512, seq=64, batch=4),
}


def log_softmax_cross_entropy(logits, targets):
    """The loss before: float32 log-probabilities of every token, then the target's (a gather)."""
    import jax
    import jax.numpy as jnp

    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]


def temporaries(shape: dict, formula: str) -> dict:
    """Compile value_and_grad of the mean cross entropy with `formula`; the memory analysis and compile time."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from models import Transformer, TransformerConfig
    from models.transformer import token_cross_entropy

    per_token = {"logsumexp": token_cross_entropy, "log_softmax": log_softmax_cross_entropy}[formula]
    config = TransformerConfig(num_layers=shape["layers"], dim=shape["dim"], num_heads=shape["heads"],
                               vocab_size=shape["vocab"], dtype="bfloat16", scan_unroll=0)
    model = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    params, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def loss(params, tokens):
        logits, _ = jax.vmap(eqx.combine(params, static).apply)(tokens[:, :-1])
        return jnp.mean(per_token(logits, tokens[:, 1:]))

    tokens = jax.ShapeDtypeStruct((shape["batch"], shape["seq"] + 1), jnp.int32)
    start = time.perf_counter()
    analysis = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile().memory_analysis()
    return {"formula": formula, "temp_bytes": analysis.temp_size_in_bytes,
            "argument_bytes": analysis.argument_size_in_bytes, "output_bytes": analysis.output_size_in_bytes,
            "compile_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_mode_flags(parser)
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    mode = args.mode or "quick"
    common.setup_jax(1)
    shape = SHAPES["smoke" if mode == "smoke" else "quick"]
    rows = [temporaries(shape, formula) for formula in ("log_softmax", "logsumexp")]
    logits_bytes = shape["batch"] * shape["seq"] * shape["vocab"] * 4
    results = {"machine": common.machine_info(), "revision": common.revision(), "mode": mode, "shape": shape,
               "float32_logits_bytes": logits_bytes, "rows": rows,
               "saved_bytes": rows[0]["temp_bytes"] - rows[1]["temp_bytes"]}
    out_dir = args.out_dir or common.default_out_dir("loss_memory", mode)
    common.write_json(out_dir / "loss_memory.json", results)
    table = common.markdown_table(
        [dict(r, temp=f"{r['temp_bytes'] / 2**30:.2f} GiB", compile=f"{r['compile_s']:.0f} s") for r in rows],
        [("loss", "formula", None), ("temporaries", "temp", None), ("compile (CPU)", "compile", None)])
    s = shape
    common.write_text(out_dir / "loss_memory.md", (
        f"# Loss temporaries (revision {results['revision']})\n\n"
        f"value_and_grad of the model's mean cross entropy, {s['layers']} x {s['dim']}, vocab {s['vocab']}, "
        f"T {s['seq']}, batch {s['batch']}, bfloat16 compute, unrolled; XLA CPU's `memory_analysis()` "
        f"(compile only). One float32 (B, T, vocab) array is {logits_bytes / 2**30:.2f} GiB.\n\n{table}\n\n"
        f"Saved: {results['saved_bytes'] / 2**30:.2f} GiB.\n"))
    print(table, flush=True)
    return results


if __name__ == "__main__":
    main()
