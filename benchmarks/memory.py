"""Memory per device of sharded islands: the train state and the compiled programs of 1B and 8B models.

Builds the CLI's `DiLoCo` (R = 2, AdamW inside, int4 outer gradients with error feedback: every
one of the ~6 parameter-sized copies a replica's device holds) for the bundled Transformer at
~1.3B and ~8B parameters, on simulated CPU devices, for several island layouts (replicated,
`--mesh.fsdp` 2 / 4 / 8, `--mesh.tensor` 2). Nothing is allocated: the state is abstract
(`jax.eval_shape`), and the inner step and the sync are compiled ahead of time on abstract
inputs (`.lower(...).compile()`). For each layout it reports

- the train state's bytes on the busiest device, from the state's shapes and shardings, and
  its ratio to the replicated layout (the acceptance: at most 1.1 / N at fsdp N);
- the compiler's `memory_analysis()` per device of the inner step and of the blocking sync
  (arguments, outputs, temporaries);
- the bytes one device sends per sync, against the replicated layout's.

    python -m benchmarks.memory                 # 16 simulated devices, ~5 minutes on 2 cores
    python -m benchmarks.memory --quick         # the ~1B model only, fsdp 1 and 8, shardings only

A second part times the default model's training (the CLI's defaults otherwise) on the same 8
CPU devices laid out as 2 islands of data 4 (replicated parameters) and of fsdp 4: a CPU has no
fast links or memory limit for sharding to pay off, so the ratio says what sharding costs here.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

from benchmarks._common import RESULTS_DIR, machine_info, revision, setup_jax, write_json
from benchmarks._harness.output import fmt_bytes, markdown_table

DEVICES = 16
MODELS = {
    "1.3B": dict(num_layers=24, dim=2048, num_heads=16, vocab_size=32768),
    "7.8B": dict(num_layers=32, dim=4096, num_heads=32, mlp_ratio=5, vocab_size=32768),
}
LAYOUTS = [dict(fsdp=1, tensor=1), dict(fsdp=2, tensor=1), dict(fsdp=4, tensor=1), dict(fsdp=8, tensor=1),
           dict(fsdp=1, tensor=2), dict(fsdp=8, tensor=1, host=True)]
BATCH, SEQ = 8, 1024


def make_core(model: dict, layout: dict):
    """The CLI's DiLoCo for `model` on `layout`, bound to the abstract model (nothing allocated)."""
    import equinox as eqx
    import jax

    from eqx_diloco.lm._core import make_diloco
    from eqx_diloco.lm.config import Config, DiLoCoConfig, MeshConfig, TrainConfig
    from models import Transformer, TransformerConfig

    config = Config(
        model=TransformerConfig(**model, remat="block"),
        train=TrainConfig(batch_size=BATCH, seq_len=SEQ),
        diloco=DiLoCoConfig(quantize="int4", error_feedback=True,
                            outer_state_memory="host" if layout.get("host") else "device"),
        mesh=MeshConfig(fsdp=layout["fsdp"], tensor=layout["tensor"]),
        compile_cache=False,
    )
    abstract_model = eqx.filter_eval_shape(Transformer, config.model, key=jax.random.key(0))
    return make_diloco(config, abstract_model), config


def state_bytes_per_device(diloco) -> int:
    """Bytes of the train state in device memory on its busiest device, from its shapes and shardings
    (arrays kept in host memory, `--diloco.outer-state-memory host`, are not counted)."""
    import jax
    import numpy as np

    per_device: dict = {}
    for x, sharding in zip(jax.tree.leaves(diloco.abstract_state), jax.tree.leaves(diloco.shardings)):
        if sharding.memory_kind == "pinned_host":
            continue
        nbytes = int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for device in sharding.device_set:
            per_device[device] = per_device.get(device, 0) + nbytes
    return max(per_device.values())


def compiled_memory(diloco, config) -> dict:
    """`memory_analysis()` per device of the inner step and of the blocking sync, on abstract inputs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from eqx_diloco._mesh import BATCH_SPEC

    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         diloco.abstract_state, diloco.shardings)
    batch = jax.ShapeDtypeStruct((diloco.num_replicas, BATCH, SEQ + 1), jnp.int32,
                                 sharding=NamedSharding(diloco.mesh, BATCH_SPEC))
    out = {}
    for name, program, args in [("inner_step", diloco.inner_step, (state, batch)),
                                ("sync", diloco.outer._fns["sync_and_merge"][0], (state,))]:
        start = time.perf_counter()
        analysis = program.lower(*args).compile().memory_analysis()
        out[name] = {
            "argument_bytes": int(analysis.argument_size_in_bytes),
            "output_bytes": int(analysis.output_size_in_bytes),
            "temp_bytes": int(analysis.temp_size_in_bytes),
            "compile_s": round(time.perf_counter() - start, 1),
        }
    return out


def measure_layouts(models: dict, layouts: list[dict], *, compile_programs: bool) -> list[dict]:
    rows = []
    for name, model in models.items():
        base = None
        for layout in layouts:
            start = time.perf_counter()
            diloco, config = make_core(model, layout)
            row = {"model": name, **layout, "parameters": int(sum(v.num_values for v in diloco._sync_groups)),
                   "state_bytes_per_device": state_bytes_per_device(diloco),
                   "wire_bytes_per_device": diloco.wire_bytes_per_device_at(config.diloco.sync_period)}
            if compile_programs:
                row["compiled"] = compiled_memory(diloco, config)
            if layout == LAYOUTS[0]:
                base = row
            if base is not None:
                shards = layout["fsdp"] * layout["tensor"]
                row["state_vs_replicated"] = row["state_bytes_per_device"] / base["state_bytes_per_device"]
                # On host: 4 of the 6 parameter-sized copies stay in device memory.
                row["state_target"] = 1.1 / shards * (4 / 6 if layout.get("host") else 1)
                row["wire_vs_replicated"] = row["wire_bytes_per_device"] / base["wire_bytes_per_device"]
                row["wire_target"] = 1.0 / shards
            rows.append(row)
            print(f"{name:>5} fsdp {layout['fsdp']} tensor {layout['tensor']}{' host' if layout.get('host') else ''}: state "
                  f"{fmt_bytes(row['state_bytes_per_device'])} per device"
                  + (f" ({row['state_vs_replicated']:.3f}x replicated)" if "state_vs_replicated" in row else "")
                  + (f", inner step temporaries {fmt_bytes(row['compiled']['inner_step']['temp_bytes'])}"
                     if "compiled" in row else "")
                  + f"  [{time.perf_counter() - start:.0f} s]", flush=True)
    return rows


def time_training(steps: int, repeats: int) -> dict:
    """Tokens/s of the default model on 8 devices: 2 islands of data 4 against 2 islands of fsdp 4,
    alternating, `repeats` times each; the ratio is taken per repeat (pairs run back to back)."""
    import statistics

    from benchmarks._harness.runs import read_metrics
    from eqx_diloco.lm.config import CheckpointConfig, Config, MeshConfig, TrainConfig
    from eqx_diloco.lm.trainer import Trainer

    out: dict = {"data4": [], "fsdp4": []}
    with tempfile.TemporaryDirectory(prefix="memory_") as tmp:
        for repeat, (name, mesh) in enumerate([("data4", MeshConfig(data=4)), ("fsdp4", MeshConfig(fsdp=4))] * repeats):
            config = Config(run_dir=pathlib.Path(tmp) / f"{name}_{repeat}", mesh=mesh, compile_cache=False,
                            train=TrainConfig(steps=steps, eval_every=0, log_every=10),
                            checkpoint=CheckpointConfig(every=0))
            summary = Trainer(config, verbose=False).run()
            lines, _ = read_metrics(config.run_dir)
            # Steady state: from the first logged step (compiles done) to the last.
            first, last = lines[0], lines[-1]
            tokens = (last["step"] - first["step"]) * config.diloco.num_replicas * config.train.batch_size \
                * config.train.seq_len
            out[name].append({"tokens_per_s": tokens / (last["time"] - first["time"]),
                              "eval_loss": float(summary["eval_loss"])})
            print(f"{name}: {out[name][-1]['tokens_per_s']:,.0f} tokens/s over {steps} steps", flush=True)
    ratios = [f["tokens_per_s"] / d["tokens_per_s"] for d, f in zip(out["data4"], out["fsdp4"])]
    out["fsdp4_vs_data4"] = {"mean": statistics.fmean(ratios), "sd": statistics.stdev(ratios) if repeats > 1 else 0.0,
                             "n": repeats, "each": ratios}
    for name in ("data4", "fsdp4"):
        out[f"{name}_tokens_per_s"] = statistics.fmean(r["tokens_per_s"] for r in out[name])
    return out


def markdown(result: dict) -> str:
    rows = [{**r, "layout": f"fsdp {r['fsdp']} x tensor {r['tensor']}" + (", outer state on host" if r.get("host") else ""),
             "step_temp": r.get("compiled", {}).get("inner_step", {}).get("temp_bytes"),
             "step_args": r.get("compiled", {}).get("inner_step", {}).get("argument_bytes"),
             "sync_temp": r.get("compiled", {}).get("sync", {}).get("temp_bytes")} for r in result["layouts"]]
    ratio = lambda v: f"{v:.3f}"  # noqa: E731
    table = markdown_table(rows, [
        ("model", "model", None), ("island", "layout", None),
        ("train state / device", "state_bytes_per_device", fmt_bytes),
        ("x replicated", "state_vs_replicated", ratio), ("target", "state_target", ratio),
        ("step arguments / device", "step_args", fmt_bytes), ("step temporaries", "step_temp", fmt_bytes),
        ("sync temporaries", "sync_temp", fmt_bytes),
        ("sent / device / sync", "wire_bytes_per_device", fmt_bytes), ("x replicated", "wire_vs_replicated", ratio),
    ])
    lines = [
        "# Sharded islands: memory per device",
        "",
        (f"{result['what']}. Revision {result['revision']}, {result['devices']} simulated CPU devices; "
         f"batch {BATCH} x {SEQ} tokens per replica, remat block. The compiled figures are XLA's "
         "`memory_analysis()` of programs compiled on abstract inputs: compiler figures, not a measured run. "
         "With the outer state on host, the train state column counts device memory only (theta_g and the outer "
         "momentum are in pinned host memory); on CPU, XLA counts host-memory arguments as arguments all the same."),
        "",
        table,
    ]
    if "training" in result:
        t = result["training"]
        ratio = t["fsdp4_vs_data4"]
        lines += ["", (f"Training speed of the default model on 8 CPU devices, {t['steps']} steps, {ratio['n']} alternating "
                       f"pairs: islands of fsdp 4 ran at {ratio['mean']:.2f} +- {ratio['sd']:.2f}x the tokens/s of islands "
                       f"of data 4 (means {t['fsdp4_tokens_per_s']:,.0f} vs {t['data4_tokens_per_s']:,.0f}). Simulated CPU "
                       "devices share two cores and one memory, so this says little about accelerators: there, sharding "
                       "pays by fitting a replica that does not fit one device, and costs the gathers over the island's "
                       "links.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the ~1B model only, fsdp 1 and 8, no compiles")
    parser.add_argument("--compile", action="store_true", help="with --quick: compile the programs all the same")
    parser.add_argument("--train-steps", type=int, default=60, help="steps of the timed training (0: skip)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating pairs of timed trainings")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR / "memory.json")
    args = parser.parse_args(argv)
    setup_jax(DEVICES)
    rev = revision()
    models = {"1.3B": MODELS["1.3B"]} if args.quick else MODELS
    layouts = [LAYOUTS[0], LAYOUTS[3]] if args.quick else LAYOUTS
    result = {
        "what": "train state and compiled programs per device, DiLoCo R = 2, AdamW inside, int4 + error feedback",
        "revision": rev, "machine": machine_info(), "devices": DEVICES,
        "layouts": measure_layouts(models, layouts, compile_programs=args.compile or not args.quick),
    }
    if args.train_steps:
        result["training"] = {"steps": args.train_steps, **time_training(args.train_steps, args.repeats)}
    write_json(args.out, result)
    args.out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
