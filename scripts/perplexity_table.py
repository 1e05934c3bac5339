"""Perplexity of SmolLM2-135M stored at each `.base` quantization, as a markdown table.

From the SmolLM2-135M-Instruct Q4_1 GGUF, writes `.base` files with store/convert.py's `convert`
(f32, q8, q6, q5, q4, q3, q2 with the default profile, q4 with the mixed profile), measures each
one's perplexity on the same text with the same context and stride (`baselm.perplexity`), and
prints: variant, file size, perplexity, change vs f32, target, met. The GGUF kept as it is is
measured too. `--kv` adds a table of KV pool precisions (16/8/4 bits) on the f32 variant;
`--groups32` a diagnostic table of q8..q4 with groups of 32 weights, the source's own groups.

NOTE: the GGUF's body is already Q4_1, so "f32" is the exactly dequantized Q4_1 weights and
each re-quantization adds its error on top of Q4_1's.

    python scripts/perplexity_table.py [--text FILE] [--context 512] [--stride 256] [--kv] [--groups32]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = REPO / "tests" / "fixtures" / "text" / "alice_chapter1.txt"


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    quant: str | None  # None: the GGUF file itself
    profile: str = "default"
    target_pct: float | None = None  # most perplexity increase over f32 allowed, in percent
    group_size: int | None = None  # None: each scheme's default
    note: str = "reported"  # the target column when there is no target


VARIANTS = (
    Variant("f32", "f32", note="reference"),
    Variant("gguf Q4_1 (as is)", None),
    Variant("q8", "q8", target_pct=0.5),
    Variant("q6", "q6", target_pct=1.0),
    Variant("q5", "q5", target_pct=2.0),
    Variant("q4", "q4", target_pct=5.0),
    Variant("mixed-q4", "q4", "mixed", target_pct=5.0),
    Variant("q3", "q3", target_pct=15.0),
    Variant("q2", "q2"),
)
# The source's own groups (Q4_1: 32 weights): shows how much of a loss comes from re-grouping.
GROUP32_VARIANTS = tuple(Variant(f"{q}-g32", q, group_size=32, note="diagnostic") for q in ("q8", "q6", "q5", "q4"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="SmolLM2 GGUF (default: the one `base` fetches)")
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--stride", type=int, default=None, help="default: context / 2")
    parser.add_argument("--workdir", type=Path, help="keep the .base files here (default: a temp folder)")
    parser.add_argument("--only", help="comma-separated variant names to measure (f32 is always measured)")
    parser.add_argument("--kv", action="store_true", help="also compare KV pools of 16, 8 and 4 bits on f32")
    parser.add_argument("--groups32", action="store_true", help="also measure q8..q4 with groups of 32 (diagnostic)")
    parser.add_argument("--json", type=Path, help="also write the measurements to this JSON file")
    return parser.parse_args()


def build(variant: Variant, gguf: Path, workdir: Path) -> Path:
    """The model file of a variant: the GGUF itself, or a `.base` converted from it."""
    from baselm.store.convert import convert

    if variant.quant is None:
        return gguf
    target = workdir / f"smollm2-135m-{variant.name}.base"
    if not target.is_file():
        convert(gguf, target, variant.quant, variant.group_size, variant.profile)
    return target


def measure(path: Path, text: str, context: int, stride: int | None, kv_bits: int = 16) -> dict:
    from baselm.backend import select_backend
    from baselm.loader import load_model
    from baselm.perplexity import encode_text, perplexity

    loaded = load_model(path, select_backend("cpu"))
    ids = encode_text(loaded.tokenizer, text)
    result = perplexity(loaded.model, ids, context, stride, kv_bits, loaded.max_model_len)
    del loaded
    gc.collect()
    return {**result.to_dict(), "size_mib": path.stat().st_size / 2**20}


def quant_table(rows: list[tuple[Variant, dict]], base: float) -> str:
    lines = [
        "| variant | file size (MiB) | perplexity | change vs f32 | target | met? |",
        "|---|---:|---:|---:|---:|:---:|",
    ]
    for variant, m in rows:
        change = 100 * (m["perplexity"] / base - 1)
        if variant.target_pct is None:
            target, met = variant.note, ""
        else:
            target, met = f"+{variant.target_pct:g}%", "yes" if change <= variant.target_pct else "no"
        cells = (variant.name, f"{m['size_mib']:.1f}", f"{m['perplexity']:.4f}", f"{change:+.2f}%", target, met)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kv_table(rows: list[tuple[int, dict]]) -> str:
    base = rows[0][1]["perplexity"]
    lines = ["| KV pool | perplexity | change vs 16 |", "|---|---:|---:|"]
    for bits, m in rows:
        label = "16 (model dtype, float32 on CPU)" if bits == 16 else f"q{bits}"
        lines.append(f"| {label} | {m['perplexity']:.4f} | {100 * (m['perplexity'] / base - 1):+.2f}% |")
    return "\n".join(lines)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main() -> None:
    args = parse_args()
    from baselm.store.default_model import fetch_default_gguf

    gguf = args.gguf or fetch_default_gguf()
    text = args.text.read_text(encoding="utf-8")
    only = set(args.only.split(",")) | {"f32"} if args.only else None
    variants = [v for v in VARIANTS + GROUP32_VARIANTS * args.groups32 if only is None or v.name in only]
    with tempfile.TemporaryDirectory() as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = []
        for variant in variants:
            path = build(variant, gguf, workdir)
            rows.append((variant, measure(path, text, args.context, args.stride)))
            log(f"{variant.name}: {json.dumps(rows[-1][1])}")
        kv_rows = [(16, rows[0][1])]
        if args.kv:
            for bits in (8, 4):
                f32_path = build(VARIANTS[0], gguf, workdir)
                kv_rows.append((bits, measure(f32_path, text, args.context, args.stride, bits)))
                log(f"kv q{bits}: {json.dumps(kv_rows[-1][1])}")
    m = rows[0][1]
    print(
        f"SmolLM2-135M-Instruct, {args.text.name}: {m['num_scored']} tokens scored, "
        f"context {m['context']}, stride {m['stride']}\n"
    )
    main_rows = [(v, r) for v, r in rows if v not in GROUP32_VARIANTS]
    print(quant_table(main_rows, m["perplexity"]))
    if args.groups32:
        print("\n" + quant_table([(v, r) for v, r in rows if v in GROUP32_VARIANTS], m["perplexity"]))
    if args.kv:
        print("\n" + kv_table(kv_rows))
    if args.json:
        args.json.write_text(json.dumps({"variants": {v.name: r for v, r in rows}, "kv": dict(kv_rows)}, indent=2))


if __name__ == "__main__":
    main()
