"""Compute-utilization simulator for data parallel, DiLoCo, Streaming DiLoCo and eager updates.

In the style of the Streaming DiLoCo paper's Table 4 (arXiv 2501.18512): for each method,
the bandwidth between replicas needed to keep the accelerators busy 50/80/90/95/99% of
the time.

Model (a per-step timeline, deterministic, no noise):

- Every inner step takes `step_s` seconds of compute. Step k starts when step k-1 has
  finished *and* every transfer due before step k has arrived.
- A sync payload is released while a step computes, by default at the end of it (DDP: the
  full gradient every step; DiLoCo: all params every H steps; Streaming: one fragment
  every H/P steps). With `backward_fraction = b > 0` the payload of layer l (of L, stack
  order) is instead released when its backward pass finishes, at `1 - b * l / L` of the
  step (layers are processed back to front; values outside the layer stack are released
  at the very end). That is the paper's assumption that the reduction is overlapped with
  the backward pass; our own trainer syncs after the step, so the default is b = 0.
- One FIFO network queue per replica. A payload of `bits` (per-replica bits: values times
  bits per value) occupies it for `2 * (R - 1) / R * bits / bandwidth` seconds: the
  traffic each replica sends (and receives) in a bandwidth-optimal ring all-reduce, with
  `bandwidth` the per-replica link in bits/s. For R = 2, the paper's setting, the factor
  is exactly 1, so with and without it the paper tables are identical. A fixed
  `latency_s` may be added to every transfer (0 by default, as in the paper's table).
- Deadline: a payload released in step t must have arrived before step t + tau + 1
  starts (compute stalls until then). tau = 0 for DDP, DiLoCo and streaming without
  overlap; tau steps of compute overlap the transfer for streaming with overlap.
- Eager updates with a 1-outer-step overlap ("Eager Updates For Overlapped Communication
  and Computation in DiLoCo", Kale, Douillard, Donchev 2025, arXiv 2502.12996): the
  replica sends its outer gradient at the end of round k and starts round k + 1 at once;
  the average of round k is needed at the next outer step, at the end of round k + 1.
  In the timeline above that is tau = H: released in step t, due before step t + H + 1.
  `eager` is plain DiLoCo (P = 1); `streaming_eager` does it per fragment, so fragment p
  (syncing at steps s_p + k H) must have its exchange back by its next sync s_p + (k + 1) H,
  also tau = H. The next send is not gated on the previous arrival (the new local outer
  gradient does not depend on the missing average); the FIFO queue serializes them. The
  `_fp4` variants send `fp4_bits` per value. The naive "delayed" variant of the paper has
  the same communication timeline, so the same numbers apply to it.
- Compute utilization = compute time / wall time, measured over whole periods of the
  schedule after warm-up periods (the system is max-plus linear and periodic, so this is
  its steady state). The wall time is floored at the link's busy time for the window's
  payload: in the steady state every period's bits cross the link once per period. That
  floor only matters for long deadlines (eager, tau = H): slightly above saturation the
  queue then falls behind for many periods before the first stall, a transient longer
  than any fixed warm-up. For tau = H every cycle of the timeline (compute, link, deadline
  edges) averages at most max(H * step_s, link time per period) per period at zero
  latency, so compute / max(window wall, link busy time) is the exact steady state.

Required bandwidth: the first point of `numpy.logspace(-1, 3, 50)` Gbit/s whose
utilization reaches the target (the paper's table seems to use that grid); the local
table extends the grid downwards with the same spacing.

Paper models (1B/10B/100B) are parameter counts (1e9, 1e10, 1e11) spread evenly over
their 24/48/108 layers (embeddings folded into the layers: the paper's fragments are
groups of 3 layers, P = L / 3, with no separate embedding fragment), strided fragments.
The local model is a real `models.TransformerConfig` whose exact fragment bytes come from
`eqx_diloco._fragments.Fragmenter.nbytes` on an abstract model (fragment 0 = embeddings,
final norm, head). Non-integer H / P (the paper's H = 100 with P = 8, 16, 36) is rounded
up: fragment p syncs at ceil((p + 1) * H / P) + k * H.

How it compares with the paper (printed next to it, geometric means in the output):

- float32 values released at the end of the step (our trainer's setting, `32:0`): DiLoCo
  and overlapped streaming need ~2.8-3.3x the paper's bandwidth, DDP and non-overlapped
  streaming far more at high targets (the paper hides each step's transfer in the
  backward pass; without that, non-overlapped streaming stalls exactly like DiLoCo).
- 16-bit values released layer by layer over the backward pass (`16:0.667`): every cell
  within 1.5x, most exactly one grid step (1.21x) above the paper. The paper's fp4 column
  is ~4x below its overlapped column (ours: 8x at 32 bits, 4x at 16), which points to
  16-bit (bf16) payloads; the last grid step may come from the paper's models having a
  little under 1e9/1e10/1e11 parameters. The ring factor is 1 at R = 2, so it cannot
  explain any of the gap.

- Eager, 1-outer-step overlap, 4-bit payloads, 99% utilization at H = 100 (`eager_fp4`,
  `streaming_eager_fp4`): the reference folder has no eager figure, so the published
  number printed beside ours is the 0.2-0.4 Gbit/s range quoted in issue 13 (`PAPER_EAGER`),
  not read off the paper. Ours: 1B 0.45, 10B 0.54 (within 1.5x of 0.4), 100B 0.95 Gbit/s
  (2.4x) on the paper's grid. No schedule can do better than the throughput bound
  target * bits per round / (H * step_s): every round's payload must cross the link once
  per round. With the step times of `PAPER_MODELS` that bound is 0.40 / 0.50 / 0.81 Gbit/s;
  eager already sits on it (it is the least a method sending these bits can need), so the
  100B miss comes from the 100B step time (4.9 s for 10x the 10B model's values), not
  from the eager timeline. A published 0.2-0.4 Gbit/s for 100B would need a step time
  about 2-4x longer (or fewer bits per round) than the Streaming DiLoCo table's.

Run `python -m benchmarks.simulate --help`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys

if __package__ in (None, ""):  # `python benchmarks/simulate.py`
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# The parts, under the names the tests and the module docstring use.
from benchmarks._simulate.comm import PAPER_MODELS, PAPER_PARAMS, ModelComm, paper_model, real_model  # noqa: F401
from benchmarks._simulate.options import Args, LocalModel, local_comm, parse_variant  # noqa: F401
from benchmarks._simulate.paper import (  # noqa: F401
    PAPER_EAGER,
    PAPER_TABLE4,
    eager_vs_paper,
    paper_reference,
    paper_tables,
    range_ratio,
    ratio_summary,
)
from benchmarks._simulate.schedule import (  # noqa: F401
    EAGER_METHODS,
    METHODS,
    Schedule,
    Transfer,
    method_schedule,
    sync_step,
)
from benchmarks._simulate.tables import fmt_gbit, markdown_table
from benchmarks._simulate.timeline import (  # noqa: F401
    GRID_GBIT,
    TARGETS,
    bandwidth_for,
    bandwidth_grid,
    method_table,
    required_bandwidth,
    ring_factor,
    throughput_bound_gbit,
    utilization,
)


def main(args: Args) -> dict:
    ref_tables, ref_source = paper_reference()
    results: dict = {
        "assumptions": {
            "transfer_s": "ring_factor(R) * per_replica_bits / bandwidth, ring_factor = 2 (R - 1) / R (1 for R = 2)",
            "release": "end of the step, or layer l at 1 - b * l / L of the step with backward fraction b",
            "deadline": "payload released in step t arrives before step t + tau + 1 starts",
            "grid_gbit": "numpy.logspace(-1, 3, 50), first point reaching the target",
            "paper_models": "1e9/1e10/1e11 values spread evenly over 24/48/108 layers; fragments of 3 layers, strided",
            "paper_schedule": "H = 100, fragment p syncs at ceil((p + 1) H / P), streaming_overlap tau = paper_tau",
            "eager": "1-outer-step overlap: released at the outer step ending round k (per fragment for "
            "streaming_eager), due before the step after the next outer step of the same fragment, i.e. tau = H",
            "replicas": args.replicas,
            "latency_s": args.latency_s,
        },
        "paper_source": ref_source,
        "targets": list(TARGETS),
        "paper": {},
    }
    for text in args.paper_variants:
        bits, bf = parse_variant(text)
        key = f"bits{bits:g}_backward{bf:.3g}"
        tables = paper_tables(
            bits=bits,
            fp4_bits=args.fp4_bits,
            backward_fraction=bf,
            tau=args.paper_tau,
            replicas=args.replicas,
            latency_s=args.latency_s,
        )
        release = "at the end of the step"
        if bf:
            release = f"layer by layer over the backward pass ({bf:.3g} of the step)"
        print(
            f"\n## Paper settings, {bits:g}-bit values (fp4 column {args.fp4_bits:g}-bit), payload released {release}; "
            f"H=100, tau={args.paper_tau}, R={args.replicas}"
        )
        print("Gbit/s needed for a compute utilization; cells: ours (paper Table 4).")
        results["paper"][key] = {"bits": bits, "backward_fraction": bf, "models": {}}
        for name, ours in tables.items():
            paper = ref_tables.get(name)
            spec = PAPER_MODELS[name]
            print(f"\n### {name} ({spec['layers']} layers, step {spec['step_s']} s, P={spec['fragments']})\n")
            print(markdown_table(ours, paper))
            entry = {"ours": ours, "paper": paper}
            if paper:
                ratios = ratio_summary(ours, paper)
                entry["ours_over_paper_geomean"] = ratios
                summary = ", ".join(f"{m} {r:.2f}" for m, r in ratios.items())
                print(f"\nours / paper (geometric mean over targets): {summary}")
            results["paper"][key]["models"][name] = entry
        eager = eager_vs_paper(
            bits=bits, backward_fraction=bf, replicas=args.replicas, latency_s=args.latency_s, fp4_bits=args.fp4_bits
        )
        lo, hi = PAPER_EAGER["range_gbit"]
        print(
            f"\n### Eager, 1-outer-step overlap, {args.fp4_bits:g}-bit payloads: Gbit/s for "
            f"{PAPER_EAGER['target']:.0%} utilization at H={PAPER_EAGER['sync_every']}, vs published {lo:g}-{hi:g}\n"
        )
        print(f"Published figure: {PAPER_EAGER['source']}.\n")
        print(
            "| model | eager_fp4 grid (exact) | streaming_eager_fp4 grid (exact) | throughput bound | published "
            "| grid / published range |"
        )
        print("|---|---|---|---|---|---|")
        for name, row in eager.items():
            e, se = row["eager_fp4"], row["streaming_eager_fp4"]
            print(
                f"| {name} | {fmt_gbit(e['grid_gbit'], 1000.0)} ({e['exact_gbit']:.3g}) "
                f"| {fmt_gbit(se['grid_gbit'], 1000.0)} ({se['exact_gbit']:.3g}) | {row['throughput_bound_gbit']:.3g} "
                f"| {lo:g}-{hi:g} | {e['grid_over_range']:.2f}x |"
            )
        results["paper"][key]["eager_vs_published"] = {"published": PAPER_EAGER, "models": eager}
    if args.local:
        comm = local_comm(args)
        grid = bandwidth_grid(1e-4)
        ours = method_table(
            comm,
            step_s=args.local_step_s,
            sync_every=args.local_sync_every,
            tau=args.local_tau,
            bits=args.local_bits,
            fp4_bits=args.fp4_bits,
            backward_fraction=args.local_backward_fraction,
            replicas=args.replicas,
            latency_s=args.latency_s,
            grid_gbit=grid,
        )
        frag_mb = [v * args.local_bits / 8 / 1e6 for v in comm.fragment_values()]
        print(
            f"\n## Local model: {comm.values:,.0f} values ({comm.values * args.local_bits / 8 / 1e6:.2f} MB at "
            f"{args.local_bits:g} bits), fragments MB {[round(m, 3) for m in frag_mb]}, step {args.local_step_s} s, "
            f"H={args.local_sync_every}, P={args.local_fragments}, tau={args.local_tau}, R={args.replicas}\n"
        )
        print("Gbit/s for a compute utilization (grid extended down to 1e-4 Gbit/s with the same spacing).\n")
        print(markdown_table(ours, grid_max=float(grid[-1])))
        results["local"] = {
            "config": dataclasses.asdict(args.local_config),
            "params": comm.values,
            "fragment_values": comm.fragment_values(),
            "step_s": args.local_step_s,
            "sync_every": args.local_sync_every,
            "fragments": args.local_fragments,
            "tau": args.local_tau,
            "bits": args.local_bits,
            "backward_fraction": args.local_backward_fraction,
            "gbit_s": ours,
        }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")
    return results


if __name__ == "__main__":
    import tyro

    main(tyro.cli(Args))
