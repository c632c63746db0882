"""The markdown report of a throughput measurement."""

from __future__ import annotations

from typing import Any

from benchmarks import _common as common


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    f = result["flops"]
    peak = result["peak"]["flops_per_s"]
    m = result["machine"]
    tp_rows = [dict(r, gflops=r["tokens_per_s"] * f["flops_per_token"] / 1e9,
                    mfu=r["tokens_per_s"] * f["flops_per_token"] / peak) for r in result["throughput"]["rows"]]
    compile_rows = []
    for r in result["compile"]:
        compile_rows.append({
            "layers": r["layers"],
            "scan": r["scan"]["total_s"], "scan_lower": r["scan"]["lower_s"],
            "unrolled": r["unrolled"]["total_s"], "unrolled_lower": r["unrolled"]["lower_s"],
            "ratio": r["unrolled_over_scan"],
            "trainer": r.get("trainer_scan", {}).get("total_s"),
        })
    sec = lambda v: f"{v:.2f}s"
    lines = [
        "# Throughput, compile time and MFU",
        "",
        f"Model: {s['num_layers']} layers, dim {s['dim']}, {s['num_heads']} heads, mlp x{s['mlp_ratio']}, "
        f"vocab 256; seq {s['seq_len']}, batch {s['batch_size']} per replica. "
        f"{f['n_params']:,} params ({f['n_matmul']:,} in matmuls); "
        f"training FLOPs/token = 6 N_matmul + 12 L T d = {f['flops_per_token'] / 1e6:.2f} M. "
        f"Machine: {m['backend']}, {m['cpu_count']} cores, jax {m['jax']}. "
        f"Peak (jitted float32 matmul, 1 device): {peak / 1e9:.1f} GFLOP/s.",
        "",
        f"## (a) Tokens/s (median of {s['rounds']} interleaved rounds x {s['steps_per_round']} steps; "
        "ratio = median per-round ratio to the plain loop)",
        "",
        common.markdown_table(tp_rows, [
            ("variant", "variant", None),
            ("tokens/step", "tokens_per_step", None),
            ("tokens/s", "tokens_per_s", lambda v: f"{v:,.0f}"),
            ("vs plain loop", "ratio_vs_plain", lambda v: f"{v:.3f}x"),
            ("model GFLOP/s", "gflops", lambda v: f"{v:.1f}"),
            ("MFU", "mfu", lambda v: f"{100 * v:.1f}%"),
        ]),
        "",
        f"## (b) Compile time of the train step (lower + compile; fastest of {s['compile_reps']} interleaved tries)",
        "",
        common.markdown_table(compile_rows, [
            ("layers", "layers", None),
            ("scan", "scan", sec),
            ("(of which lower)", "scan_lower", sec),
            ("unrolled", "unrolled", sec),
            ("(of which lower)", "unrolled_lower", sec),
            ("unrolled / scan", "ratio", lambda v: f"{v:.2f}x"),
            ("trainer inner step (scan)", "trainer", sec),
        ]),
        "",
        "Timing noise: wall-clock numbers on a shared machine; ratios are measured within one run.",
        "",
    ]
    return "\n".join(lines)
