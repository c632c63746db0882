"""Peak sync size per fragment pattern on a model with a real vocabulary.

Streaming DiLoCo sends one fragment every H/P steps, so the largest fragment sets the
bandwidth a link must sustain. With the default layout, fragment 0 holds everything
outside the layer stack; with a 32k vocabulary (untied embeddings and head) that is most
of the model. This script builds the abstract model (no weights are computed) and reports
each fragment's float32 bytes and int4 payload bytes (scales included) for the `strided`
and `balanced` patterns, plus the peak ratio. Deterministic: shapes only.

    python -m benchmarks.fragments                      # prints the table, writes runs/benchmarks/fragments
    python -m benchmarks.fragments --out benchmarks/results
"""

import argparse
import json
import pathlib
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=32_000)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--num-fragments", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/benchmarks/fragments"))
    args = parser.parse_args(argv)

    import equinox as eqx
    import jax

    from eqx_diloco import quantize
    from eqx_diloco._fragments import Fragmenter
    from models import Transformer, TransformerConfig

    config = TransformerConfig(vocab_size=args.vocab_size, num_layers=args.num_layers, dim=args.dim)
    model = eqx.filter_eval_shape(Transformer, config, key=jax.random.key(0))
    rows = {}
    for pattern in ("strided", "balanced"):
        frag = Fragmenter.for_model(model, lambda m: m.blocks, args.num_fragments, pattern)
        f32 = [frag.nbytes(model, p) for p in range(args.num_fragments)]
        int4 = [quantize.payload_nbytes((n // 4,), "int4") for n in f32]
        rows[pattern] = {"float32_bytes": f32, "int4_payload_bytes": int4, "peak_float32": max(f32),
                         "total_float32": sum(f32)}
    ratio = rows["strided"]["peak_float32"] / rows["balanced"]["peak_float32"]
    lines = [f"Transformer: vocab {args.vocab_size}, {args.num_layers} layers, width {args.dim}, untied head; "
             f"P = {args.num_fragments}", "",
             "| pattern | float32 MB per fragment | int4 payload MB per fragment | peak (float32) | total |",
             "|---|---|---|---|---|"]
    for pattern, r in rows.items():
        mb = lambda xs: ", ".join(f"{x / 1e6:.2f}" for x in xs)  # noqa: E731
        lines.append(f"| {pattern} | {mb(r['float32_bytes'])} | {mb(r['int4_payload_bytes'])} | "
                     f"{r['peak_float32'] / 1e6:.2f} MB | {r['total_float32'] / 1e6:.2f} MB |")
    lines += ["", f"peak strided / peak balanced: {ratio:.2f}x (same total bytes)"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fragments.json").write_text(json.dumps({**{k: v for k, v in vars(args).items() if k != "out"}, "patterns": rows,
                                                         "peak_ratio": ratio}, indent=2) + "\n")
    (args.out / "fragments.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
