"""The CLI's step on an accelerator (GPU or TPU): tokens/s, MFU and peak memory for the model shapes
labs train, beside a plain JAX loop of the same model and a PyTorch loop of the same shape, in one run.

Shapes (decoder: pre-norm RMSNorm, RoPE, q/k/v projections, GELU MLP x4, untied head, vocab 32768,
T = 1024):

    A    12 layers x 768, 12 heads, batch 16   (135M parameters)
    B    24 layers x 2048, 16 heads, batch 8   (1.34B parameters)
    B4    4 layers x 2048, 16 heads, batch 8   (B's width at the depth whose DiLoCo state, two
                                               replicas on one device, fits a 16 GiB chip)

Variants, each measured in its own process (so each peak memory is its own, and one that runs
out of memory does not take the others with it):

    cli         the CLI's defaults as typed (`Trainer` of a default `Config` at the shape): R = 2
                on the devices there are, `--model.scan-unroll auto` (every layer unrolled on GPU
                and TPU), and the trainer's own fit check, which may pick `--model.remat block`
                (its line is in the table)
    unrolled    the trainer's inner step at R = 1, `--model.scan-unroll 0` (every layer unrolled)
    rolled      the same with `--model.scan-unroll 1` (one layer per iteration of the scan)
    plain       a plain `jax.jit` loop: value_and_grad of the model's loss + the trainer's
                AdamW (clipping, schedule, decay mask), params and state donated, unrolled
    round       a whole DiLoCo round at R = 1: H = 50 inner steps and the outer step
                (`DiLoCo.step`), against 50 plain steps
    torch       a PyTorch loop of the shape (bf16 autocast, SDPA, torch.compile, fused AdamW),
                the script given by `--torch-ref` or $EQX_DILOCO_TORCH_REF and run by
                `--torch-python`; torch is never a dependency of this project, and the table says
                when no reference was given or it could not run

Every variant uses the model's precision policy (`--dtype`, default auto = bfloat16 on GPU and TPU)
and attention kernel (`--attention`, auto = cuDNN flash attention on NVIDIA GPUs). MFU is model FLOPs
(`benchmarks/throughput.py`'s formula) over two peaks: the device's bfloat16 matmul rate measured in
the same run (an n x n x n product, n = 8192; `--matmul`), and the card's specification (`SPECS`, by
JAX's device kind; `--spec-tflops` for another card). Peak memory is the device allocator's
`peak_bytes_in_use` (None on CPU, which keeps no such figure). Needs only jax, equinox, optax, numpy
(and the repository).

    python -m benchmarks.gpu --shapes A,B --out-dir benchmarks/results
    python -m benchmarks.gpu --shapes A,B:cli,B4 --variants cli,unrolled,rolled,plain,torch --steps 5 \
        --rounds 2 --budget-s 420 --timeout-s 200 --out-dir "$OUT"    # one TPU v5e chip, within 8 minutes
    python -m benchmarks.gpu --smoke   # a tiny shape on CPU: checks the harness, no claims

Writes `gpu.json` and `gpu.md` in `--out-dir` (default: $EQX_DILOCO_BENCH_OUT, else
`runs/benchmarks/gpu_<mode>`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import _common as common
from benchmarks._harness.device_timing import measure_matmul, peak_bytes, time_calls

SHAPES = {
    "A": dict(layers=12, dim=768, heads=12, vocab=32768, seq=1024, batch=16),
    "B": dict(layers=24, dim=2048, heads=16, vocab=32768, seq=1024, batch=8),
    "B4": dict(layers=4, dim=2048, heads=16, vocab=32768, seq=1024, batch=8),
    "smoke": dict(layers=2, dim=64, heads=4, vocab=512, seq=64, batch=4),
}
VARIANTS = ("cli", "unrolled", "rolled", "plain", "round", "torch")
TORCH_REF_ENV = "EQX_DILOCO_TORCH_REF"
# Dense bfloat16 peaks (TFLOP/s) and memory (GiB) by JAX's `device_kind`, from the makers' data sheets
# (SXM parts for NVIDIA); the first key found in the kind names the card.
SPECS = {
    "TPU v5 lite": (197, 16), "TPU v5e": (197, 16), "TPU v5p": (459, 95), "TPU v4": (275, 32),
    "TPU v6 lite": (918, 32), "H200": (989, 141), "H100": (989, 80), "A100": (312, 80), "L4": (121, 24),
}


# -- one variant, in a child process ----------------------------------------------------------


def _configs(shape: dict, opts: dict, *, variant: str, sync_period: int, run_dir: pathlib.Path):
    """The `Config` of a variant: the CLI's defaults at the shape (`cli`), else R = 1 with the variant's unroll."""
    from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig, MeshConfig, TrainConfig
    from models import TransformerConfig

    unroll = {"rolled": 1, "cli": "auto"}.get(variant, 0)
    model = TransformerConfig(num_layers=shape["layers"], dim=shape["dim"], num_heads=shape["heads"],
                              vocab_size=shape["vocab"], dtype=opts["dtype"], attention=opts["attention"],
                              scan_unroll=unroll)
    train = TrainConfig(steps=1_000_000, batch_size=shape["batch"], seq_len=shape["seq"], lr=3e-4, warmup_steps=10,
                        eval_every=0, log_every=1_000_000, eval_sequences=1)
    if variant == "cli":  # R, mesh, remat and the rest as a user who types only the shape gets them
        return Config(run_dir=run_dir, model=model, train=train, data=DataConfig(source="synthetic"),
                      checkpoint=CheckpointConfig(every=0), compile_cache=False)
    return Config(algorithm="diloco", run_dir=run_dir, model=model, train=train,
                  diloco=DiLoCoConfig(num_replicas=1, sync_period=sync_period),
                  mesh=MeshConfig(replicas_per_device=1), data=DataConfig(source="synthetic"),
                  checkpoint=CheckpointConfig(every=0))


def measure_variant(shape: dict, variant: str, opts: dict) -> dict[str, Any]:
    """Time one JAX variant of one shape in this process (see the module docstring)."""
    import equinox as eqx
    import jax
    import numpy as np

    from benchmarks._throughput.plain_loop import make_plain_step, plain_optimizer
    from eqx_diloco.lm.trainer import Trainer

    if opts.get("cache_dir"):  # the trainer's fit check compiles the step once ahead; the loop's compile is then a hit
        jax.config.update("jax_compilation_cache_dir", opts["cache_dir"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    B, T = shape["batch"], shape["seq"]
    timing = dict(warmup=opts["warmup"], steps=opts["steps"], rounds=opts["rounds"])
    H = opts["round_steps"] if variant == "round" else 1_000_000
    setup: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as run_dir:
        config = _configs(shape, opts, variant=variant, sync_period=H, run_dir=pathlib.Path(run_dir))
        trainer = Trainer(config, verbose=False)
        m = trainer.config.model
        setup = {"banner": trainer.banner_lines(), "remat": m.remat, "layers_per_iteration": m.layers_per_iteration(),
                 "replicas": trainer.config.diloco.num_replicas, "mesh": dict(trainer.mesh.shape)}
        replicas = trainer.config.diloco.num_replicas
        tokens = np.random.default_rng(0).integers(0, shape["vocab"], (replicas, B, T + 1)).astype(np.int32)
        state, _ = trainer.initial_state()
        batch = jax.device_put(tokens, trainer.batch_sharding)
        if variant == "plain":
            model = eqx.combine(jax.tree.map(lambda x: x[0], state.params), trainer.core.static)
            del state, trainer
            params, static = eqx.partition(model, eqx.is_array)
            optimizer = plain_optimizer(config.train, model)
            carry = [params, optimizer.init(params)]
            plain_step, one = make_plain_step(optimizer, static), jax.device_put(tokens[0])

            def step():
                carry[0], carry[1], _ = plain_step(carry[0], carry[1], one)

            result = time_calls(step, lambda: jax.block_until_ready(carry), **timing)
        elif variant == "round":
            holder = [state]

            def one_round():
                for _ in range(H):
                    holder[0], _ = trainer.core.step(holder[0], batch)

            result = time_calls(one_round, lambda: jax.block_until_ready(holder[0]), warmup=1, steps=1,
                                rounds=opts["rounds"])
            result["step_s"] /= H  # per inner step, the outer step's share included
            result["round_steps"] = H
        else:
            holder = [state]

            def step():
                holder[0], _ = trainer.inner_step(holder[0], batch)

            result = time_calls(step, lambda: jax.block_until_ready(holder[0]), **timing)
    result.update(variant=variant, tokens_per_step=replicas * B * T, peak_bytes=peak_bytes(), **setup)
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_s"]
    return result


def _child(args) -> None:
    import jax  # JAX starts here, in the child, with its own device memory

    shape, opts = json.loads(args.child_shape), json.loads(args.child_opts)
    if args.child == "matmul":  # also what the parent must not ask JAX itself (see `main`)
        out = dict(measure_matmul(opts["matmul"]), machine=common.machine_info(),
                   device_kind=jax.devices()[0].device_kind)
    else:
        out = measure_variant(shape, args.child, opts)
    print("RESULT " + json.dumps(common.jsonable(out)), flush=True)


# -- the orchestration ------------------------------------------------------------------------


def _run_child(kind: str, shape: dict, opts: dict, timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.gpu", "--child", kind, "--child-shape", json.dumps(shape),
               "--child-opts", json.dumps(opts)]
    try:
        done = subprocess.run(command, cwd=common.REPO, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"variant": kind, "error": f"timed out after {timeout_s:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    out_of_memory = "RESOURCE_EXHAUSTED" in done.stderr or "out of memory" in done.stderr.lower()
    refused = [line for line in done.stderr.splitlines() if "ConfigError: " in line]  # the fit check's line
    if refused:
        return {"variant": kind, "error": "does not fit: " + refused[-1].split("ConfigError: ", 1)[1][:600]}
    return {"variant": kind, "error": "out of memory" if out_of_memory else tail[0][:300]}


def _run_torch(shape: dict, opts: dict, python: str, script: pathlib.Path | None, timeout_s: float) -> dict[str, Any]:
    if script is None:
        return {"variant": "torch", "error": f"missing: no PyTorch reference given (--torch-ref or ${TORCH_REF_ENV})"}
    if not script.is_file():
        return {"variant": "torch", "error": f"missing: no PyTorch reference at {script} (--torch-ref or ${TORCH_REF_ENV})"}
    try:
        probe = subprocess.run([python, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
                               capture_output=True, text=True, timeout=120)
    except OSError:
        probe = None
    if probe is None or probe.returncode != 0:
        return {"variant": "torch", "error": f"torch is not installed for {python} (--torch-python)"}
    command = [python, str(script), "--layers", str(shape["layers"]), "--dim", str(shape["dim"]),
               "--heads", str(shape["heads"]), "--vocab", str(shape["vocab"]), "--seq", str(shape["seq"]),
               "--batch", str(shape["batch"]), "--steps", str(opts["steps"]), "--rounds", str(opts["rounds"])]
    if opts["backend"] == "cpu":
        command.append("--no-compile")  # the compiler's C++ toolchain is a GPU run's business
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"variant": "torch", "error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"variant": "torch", "error": tail[0][:300]}
    record = json.loads(lines[-1])
    return {"variant": "torch", "tokens_per_s": record["tokens_per_s"], "step_s": record["step_s"],
            "peak_bytes": record.get("peak_bytes"), "torch": record.get("torch"), "mode": record.get("mode"),
            "torch_cuda": probe.stdout.strip()}


def spec_peak(device_kind: str) -> tuple[float, float] | None:
    """(bfloat16 TFLOP/s, memory GiB) of the card JAX calls `device_kind`, or None if not in `SPECS`."""
    return next((spec for name, spec in SPECS.items() if name.lower() in device_kind.lower()), None)


def _table(results: dict[str, Any]) -> str:
    columns = [(h, h, None) for h in ("variant", "tokens/s", "MFU (measured peak)", "MFU (spec)", "peak memory",
                                      "vs plain", "vs torch", "set-up")]
    lines = []
    for name, shape_result in results["shapes"].items():
        rows = []
        plain = shape_result["rows"].get("plain", {}).get("tokens_per_s")
        torch_row = shape_result["rows"].get("torch", {})
        torch_tps = torch_row.get("tokens_per_s")
        for variant, row in shape_result["rows"].items():
            if "error" in row:
                rows.append({"variant": variant, "tokens/s": row["error"]})
                continue
            tps = row["tokens_per_s"]
            setup = None
            if "remat" in row:
                per = row["layers_per_iteration"]
                setup = (f"R {row['replicas']}, remat {row['remat']}, "
                         + ("unrolled" if per == shape_result["shape"]["layers"] else f"{per} layer(s) per iteration"))
            rows.append({
                "variant": variant, "tokens/s": f"{tps:,.0f}",
                "MFU (measured peak)": f"{100 * row['mfu']:.1f}%" if row.get("mfu") else None,
                "MFU (spec)": f"{100 * row['mfu_spec']:.1f}%" if row.get("mfu_spec") else None,
                "peak memory": common.fmt_bytes(row["peak_bytes"]) if row.get("peak_bytes") else None,
                "vs plain": f"{tps / plain:.3f}x" if plain and variant != "plain" else None,
                "vs torch": f"{tps / torch_tps:.3f}x" if torch_tps and variant != "torch" else None,
                "set-up": setup,
            })
        s = shape_result["shape"]
        lines.append(f"### shape {name}: {s['layers']} x {s['dim']}, {s['heads']} heads, vocab {s['vocab']}, "
                     f"T {s['seq']}, batch {s['batch']}\n")
        if not torch_tps:
            lines.append(f"No PyTorch reference in this run ({torch_row.get('error', 'not asked for')}): "
                         f"the `vs torch` column is empty.\n")
        lines.append(common.markdown_table(rows, columns) + "\n")
        for variant, row in shape_result["rows"].items():
            for line in row.get("banner", []):
                lines.append(f"    {variant}: {line.strip()}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--shapes", default="A,B", help="comma-separated: A, B, B4 (smoke: a tiny one); NAME:v1+v2 runs "
                        "only those variants of NAME")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-steps", type=int, default=50, help="H of the DiLoCo round")
    parser.add_argument("--matmul", type=int, default=8192, help="n of the bfloat16 peak's n^3 product")
    parser.add_argument("--torch-ref", type=pathlib.Path,
                        default=pathlib.Path(os.environ[TORCH_REF_ENV]) if os.environ.get(TORCH_REF_ENV) else None,
                        help=f"the PyTorch reference loop (default: ${TORCH_REF_ENV}; none: the table says so)")
    parser.add_argument("--spec-tflops", type=float, default=None,
                        help="the card's bfloat16 peak for the spec MFU (default: SPECS by JAX's device kind)")
    parser.add_argument("--torch-python", default=os.environ.get("EQX_DILOCO_TORCH_PYTHON", sys.executable))
    parser.add_argument("--timeout-s", type=float, default=1200, help="per variant")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="the whole run's seconds: variants that would start later are skipped (the table says so)")
    parser.add_argument("--out-dir", type=pathlib.Path,
                        default=pathlib.Path(os.environ["EQX_DILOCO_BENCH_OUT"]) if os.environ.get("EQX_DILOCO_BENCH_OUT")
                        else None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-shape", help=argparse.SUPPRESS)
    parser.add_argument("--child-opts", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return None
    mode = args.mode or "quick"
    smoke = mode == "smoke"
    # This process never starts JAX's backend: a TPU chip opens in one process at a time, so every
    # figure, the device's own included, comes from a child.
    cache_dir = tempfile.mkdtemp(prefix="eqx_diloco_gpu_bench_cache_")
    opts = dict(dtype=args.dtype, attention=args.attention, cache_dir=cache_dir,
                steps=1 if smoke else args.steps, rounds=2 if smoke else args.rounds, warmup=2,
                round_steps=4 if smoke else args.round_steps, matmul=256 if smoke else args.matmul)
    variants = args.variants.split(",")
    # "NAME" runs --variants; "NAME:v1+v2" only those
    plan = [("smoke", variants)] if smoke else [
        (item.split(":")[0], item.split(":")[1].split("+") if ":" in item else variants)
        for item in (s.strip() for s in args.shapes.split(",")) if item]
    shapes = [name for name, _ in plan]
    unknown = [s for s in shapes if s not in SHAPES] + [v for _, vs in plan for v in vs if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown shape or variant: {', '.join(unknown)} (shapes {', '.join(SHAPES)}; variants "
                     f"{', '.join(VARIANTS)})")
    from benchmarks._throughput.settings import model_flops
    from models import TransformerConfig

    started = time.perf_counter()
    peak = _run_child("matmul", {}, opts, args.timeout_s)
    if "error" in peak:
        raise SystemExit(f"the device probe failed: {peak['error']}")
    machine, device_kind = peak.pop("machine"), peak.pop("device_kind")
    backend = opts["backend"] = machine["backend"]
    if backend == "cpu":
        print(f"no accelerator here (JAX backend {backend}): "
              + ("the smoke shape checks the harness only; its numbers are not GPU or TPU figures" if smoke
                 else "the figures below are not GPU or TPU figures"), flush=True)
    spec = spec_peak(device_kind)
    spec_flops = args.spec_tflops * 1e12 if args.spec_tflops else (spec[0] * 1e12 if spec else None)
    print(f"bfloat16 matmul peak: {peak.get('flops_per_s', 0) / 1e12:.1f} TFLOP/s (n = {opts['matmul']})", flush=True)
    print(f"{device_kind} specification: " + (f"{spec_flops / 1e12:.0f} TFLOP/s bfloat16" if spec_flops else
          "not in SPECS (--spec-tflops)"), flush=True)
    results: dict[str, Any] = {"machine": machine, "revision": common.revision(), "mode": mode,
                               "device_kind": device_kind, "options": opts, "bf16_peak": peak,
                               "spec_flops_per_s": spec_flops, "spec_memory_gib": spec[1] if spec else None,
                               "shapes": {}}
    out_dir = args.out_dir or common.default_out_dir("gpu", mode)
    for name, shape_variants in plan:
        shape = SHAPES[name]
        cfg = TransformerConfig(num_layers=shape["layers"], dim=shape["dim"], num_heads=shape["heads"],
                                vocab_size=shape["vocab"])
        flops = model_flops(cfg, shape["seq"])["flops_per_token"]
        rows = {}
        results["shapes"][name] = {"shape": shape, "flops_per_token": flops, "rows": rows}
        for variant in shape_variants:
            t0 = time.perf_counter()
            left = args.budget_s - (t0 - started) if args.budget_s else math.inf
            if variant == "torch":
                row = _run_torch(shape, opts, args.torch_python, args.torch_ref, args.timeout_s)
            elif left < 30:
                row = {"variant": variant, "error": f"skipped: --budget-s {args.budget_s:g} spent"}
            else:
                row = _run_child(variant, shape, opts, min(args.timeout_s, left))
            if "tokens_per_s" in row and peak.get("flops_per_s"):
                row["mfu"] = row["tokens_per_s"] * flops / peak["flops_per_s"]
            if "tokens_per_s" in row and spec_flops:
                row["mfu_spec"] = row["tokens_per_s"] * flops / spec_flops
            rows[variant] = row
            said = row.get("error") or f"{row['tokens_per_s']:,.0f} tokens/s"
            print(f"shape {name} {variant:9s} {said}  ({time.perf_counter() - t0:.0f} s)", flush=True)
            _write(out_dir, results, peak, spec_flops)  # after every row: a run cut short keeps what it measured
    shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"wrote {out_dir / 'gpu.json'} and gpu.md", flush=True)
    return results


def _write(out_dir: pathlib.Path, results: dict[str, Any], peak: dict[str, Any], spec_flops: float | None) -> None:
    common.write_json(out_dir / "gpu.json", results)
    device_kind, opts = results["device_kind"], results["options"]
    spec_text = f"{spec_flops / 1e12:.0f} TFLOP/s" if spec_flops else "unknown"
    title = (f"# The CLI's step on {device_kind} ({results['machine']['backend']}, revision {results['revision']})\n\n"
             f"bfloat16 peaks: measured {peak.get('flops_per_s', 0) / 1e12:.1f} TFLOP/s (an n = {opts['matmul']} "
             f"matmul), specification {spec_text}.")
    common.write_text(out_dir / "gpu.md", f"{title}\n\n{_table(results)}\n")


if __name__ == "__main__":
    main()
