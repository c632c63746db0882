"""The CLI's step on a GPU: tokens/s, MFU and peak memory for the model shapes labs train,
beside a plain JAX loop of the same model and a PyTorch loop of the same shape, in one run.

Shapes (decoder: pre-norm RMSNorm, RoPE, q/k/v projections, GELU MLP x4, untied head, vocab 32768,
T = 1024):

    A   12 layers x 768, 12 heads, batch 16   (135M parameters)
    B   24 layers x 2048, 16 heads, batch 8   (1.34B parameters)

Variants, each measured in its own process (so each peak memory is its own, and one that runs
out of memory does not take the others with it):

    plain       a plain `jax.jit` loop: value_and_grad of the model's loss + the trainer's
                AdamW (clipping, schedule, decay mask), params and state donated
    inner-r1    the trainer's DiLoCo inner step, R = 1 (`Trainer.inner_step`)
    inner-r2    R = 2 on the same one device (`--mesh.replicas-per-device 2`, vmapped)
    round       a whole DiLoCo round at R = 1: H = 50 inner steps and the outer step
                (`DiLoCo.step`), against 50 plain steps
    torch       `--torch-ref` (a PyTorch loop of the shape: bf16 autocast, SDPA,
                torch.compile, fused AdamW) run by `--torch-python`; torch is never a
                dependency of this project, and the run says so when it cannot import it

Every variant uses the model's precision policy (`--dtype`, default auto = bfloat16 on a GPU),
attention kernel (`--attention`, auto = cuDNN flash attention on NVIDIA GPUs), `--remat` and
`--scan-unroll` (default 0, all layers unrolled, on a GPU; 1 on CPU). MFU is model FLOPs
(`benchmarks/throughput.py`'s formula) over the device's bfloat16 matmul peak, measured in the
same run (an n x n x n product, n = 8192; `--matmul`). Peak memory is the device allocator's
`peak_bytes_in_use` (None on CPU, which keeps no such figure).

    python -m benchmarks.gpu --shapes A,B --out-dir benchmarks/results
    python -m benchmarks.gpu --smoke   # a tiny shape on CPU: checks the harness, no claims

Writes `gpu.json` and `gpu.md` in `--out-dir` (default `runs/benchmarks/gpu_<mode>`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
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
    "smoke": dict(layers=2, dim=64, heads=4, vocab=512, seq=64, batch=4),
}
VARIANTS = ("plain", "inner-r1", "inner-r2", "round", "torch")
DEFAULT_TORCH_REF = common.REPO.parent / "shared" / "peers" / "gpu" / "torch_ref.py"


# -- one variant, in a child process ----------------------------------------------------------


def _configs(shape: dict, opts: dict, *, replicas: int, sync_period: int, run_dir: pathlib.Path):
    from eqx_diloco.lm.config import CheckpointConfig, Config, DataConfig, DiLoCoConfig, MeshConfig, TrainConfig
    from models import TransformerConfig

    model = TransformerConfig(num_layers=shape["layers"], dim=shape["dim"], num_heads=shape["heads"],
                              vocab_size=shape["vocab"], dtype=opts["dtype"], attention=opts["attention"],
                              remat=opts["remat"], scan_unroll=opts["scan_unroll"])
    train = TrainConfig(steps=1_000_000, batch_size=shape["batch"], seq_len=shape["seq"], lr=3e-4, warmup_steps=10,
                        eval_every=0, log_every=1_000_000, eval_sequences=1)
    return Config(algorithm="diloco", run_dir=run_dir, model=model, train=train,
                  diloco=DiLoCoConfig(num_replicas=replicas, sync_period=sync_period),
                  mesh=MeshConfig(replicas_per_device=replicas), data=DataConfig(source="synthetic"),
                  checkpoint=CheckpointConfig(every=0))


def measure_variant(shape: dict, variant: str, opts: dict) -> dict[str, Any]:
    """Time one JAX variant of one shape in this process (see the module docstring)."""
    import equinox as eqx
    import jax
    import numpy as np

    from benchmarks._throughput.plain_loop import make_plain_step, plain_optimizer
    from eqx_diloco.lm.trainer import Trainer

    B, T = shape["batch"], shape["seq"]
    tokens = np.random.default_rng(0).integers(0, shape["vocab"], (1, B, T + 1)).astype(np.int32)
    timing = dict(warmup=opts["warmup"], steps=opts["steps"], rounds=opts["rounds"])
    replicas = 2 if variant == "inner-r2" else 1
    H = opts["round_steps"] if variant == "round" else 1_000_000
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(_configs(shape, opts, replicas=replicas, sync_period=H, run_dir=pathlib.Path(run_dir)),
                          verbose=False)
        state, _ = trainer.initial_state()
        batch = jax.device_put(np.concatenate([tokens] * replicas), trainer.batch_sharding)
        if variant == "plain":
            model = eqx.combine(jax.tree.map(lambda x: x[0], state.params), trainer.core.static)
            del state, trainer
            params, static = eqx.partition(model, eqx.is_array)
            optimizer = plain_optimizer(_configs(shape, opts, replicas=1, sync_period=H,
                                                 run_dir=pathlib.Path(run_dir)).train, model)
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
    result.update(variant=variant, tokens_per_step=replicas * B * T, peak_bytes=peak_bytes())
    result["tokens_per_s"] = result["tokens_per_step"] / result["step_s"]
    return result


def _child(args) -> None:
    import jax  # noqa: F401  (JAX starts here, in the child, with its own device memory)

    shape, opts = json.loads(args.child_shape), json.loads(args.child_opts)
    if args.child == "matmul":
        out = measure_matmul(opts["matmul"])
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
    return {"variant": kind, "error": "out of memory" if out_of_memory else tail[0][:300]}


def _run_torch(shape: dict, opts: dict, python: str, script: pathlib.Path, timeout_s: float) -> dict[str, Any]:
    if not script.is_file():
        return {"variant": "torch", "error": f"no PyTorch reference at {script} (--torch-ref)"}
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


def _table(results: dict[str, Any]) -> str:
    columns = [(h, h, None) for h in ("variant", "tokens/s", "MFU", "peak memory", "vs plain", "vs torch")]
    lines = []
    for name, shape_result in results["shapes"].items():
        rows = []
        plain = shape_result["rows"].get("plain", {}).get("tokens_per_s")
        torch_tps = shape_result["rows"].get("torch", {}).get("tokens_per_s")
        for variant, row in shape_result["rows"].items():
            if "error" in row:
                rows.append({"variant": variant, "tokens/s": row["error"]})
                continue
            tps = row["tokens_per_s"]
            rows.append({
                "variant": variant, "tokens/s": f"{tps:,.0f}",
                "MFU": f"{100 * row['mfu']:.1f}%" if row.get("mfu") else None,
                "peak memory": common.fmt_bytes(row["peak_bytes"]) if row.get("peak_bytes") else None,
                "vs plain": f"{tps / plain:.3f}x" if plain and variant != "plain" else None,
                "vs torch": f"{tps / torch_tps:.3f}x" if torch_tps and variant != "torch" else None,
            })
        s = shape_result["shape"]
        lines.append(f"### shape {name}: {s['layers']} x {s['dim']}, {s['heads']} heads, vocab {s['vocab']}, "
                     f"T {s['seq']}, batch {s['batch']}\n")
        lines.append(common.markdown_table(rows, columns) + "\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_mode_flags(parser)
    parser.add_argument("--shapes", default="A,B", help="comma-separated: A, B (smoke: a tiny one)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    parser.add_argument("--remat", default="none", choices=["none", "block", "dots"])
    parser.add_argument("--scan-unroll", type=int, default=None, help="default: 0 (all layers) on a GPU, 1 on CPU")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round-steps", type=int, default=50, help="H of the DiLoCo round")
    parser.add_argument("--matmul", type=int, default=8192, help="n of the bfloat16 peak's n^3 product")
    parser.add_argument("--torch-ref", type=pathlib.Path, default=DEFAULT_TORCH_REF)
    parser.add_argument("--torch-python", default=os.environ.get("EQX_DILOCO_TORCH_PYTHON", sys.executable))
    parser.add_argument("--timeout-s", type=float, default=1200, help="per variant")
    parser.add_argument("--out-dir", type=pathlib.Path, default=None)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-shape", help=argparse.SUPPRESS)
    parser.add_argument("--child-opts", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args)
        return None
    mode = args.mode or "quick"
    import jax

    backend = jax.default_backend()
    smoke = mode == "smoke"
    if backend != "gpu":
        print(f"no GPU here (JAX backend {backend}): "
              + ("the smoke shape checks the harness only; its numbers are not GPU figures" if smoke
                 else "the figures below are not GPU figures"), flush=True)
    opts = dict(dtype=args.dtype, attention=args.attention, remat=args.remat, backend=backend,
                scan_unroll=args.scan_unroll if args.scan_unroll is not None else (0 if backend == "gpu" else 1),
                steps=1 if smoke else args.steps, rounds=2 if smoke else args.rounds, warmup=2,
                round_steps=4 if smoke else args.round_steps, matmul=256 if smoke else args.matmul)
    shapes = ["smoke"] if smoke else [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES] + [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown shape or variant: {', '.join(unknown)} (shapes A, B; variants {', '.join(VARIANTS)})")
    from benchmarks._throughput.settings import model_flops
    from models import TransformerConfig

    peak = _run_child("matmul", {}, opts, args.timeout_s)
    print(f"bfloat16 matmul peak: {peak.get('flops_per_s', 0) / 1e12:.1f} TFLOP/s (n = {opts['matmul']})", flush=True)
    results: dict[str, Any] = {"machine": common.machine_info(), "revision": common.revision(), "mode": mode,
                               "options": opts, "bf16_peak": peak, "shapes": {}}
    for name in shapes:
        shape = SHAPES[name]
        cfg = TransformerConfig(num_layers=shape["layers"], dim=shape["dim"], num_heads=shape["heads"],
                                vocab_size=shape["vocab"])
        flops = model_flops(cfg, shape["seq"])["flops_per_token"]
        rows = {}
        for variant in args.variants.split(","):
            t0 = time.perf_counter()
            if variant == "torch":
                row = _run_torch(shape, opts, args.torch_python, args.torch_ref, args.timeout_s)
            else:
                row = _run_child(variant, shape, opts, args.timeout_s)
            if "tokens_per_s" in row and peak.get("flops_per_s"):
                row["mfu"] = row["tokens_per_s"] * flops / peak["flops_per_s"]
            rows[variant] = row
            said = row.get("error") or f"{row['tokens_per_s']:,.0f} tokens/s"
            print(f"shape {name} {variant:9s} {said}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        results["shapes"][name] = {"shape": shape, "flops_per_token": flops, "rows": rows}
    out_dir = args.out_dir or common.default_out_dir("gpu", mode)
    common.write_json(out_dir / "gpu.json", results)
    device = results["machine"]["backend"]
    title = f"# GPU step ({device}, revision {results['revision']})"
    common.write_text(out_dir / "gpu.md", f"{title}\n\n{_table(results)}\n")
    print(f"wrote {out_dir / 'gpu.json'} and gpu.md", flush=True)
    return results


if __name__ == "__main__":
    main()
