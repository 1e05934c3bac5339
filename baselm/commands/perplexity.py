"""`base perplexity`: a model's perplexity on a text file (baselm/perplexity.py does the work)."""

from __future__ import annotations

import json

import typer

from baselm.commands.errors import fail, user_errors
from baselm.commands.options import DEVICE, KV_BITS, MODEL_HELP

commands = typer.Typer()  # merged into the `base` app by cli.py


@commands.command()
def perplexity(
    model: str = typer.Argument(..., help=MODEL_HELP),
    text_file: str = typer.Argument(..., help="A UTF-8 plain-text file (no chat template is applied)."),
    context: int = typer.Option(512, "--context", help="Tokens per window."),
    stride: int | None = typer.Option(
        None, "--stride", help="Tokens between window starts, less than --context (default: half)."
    ),
    kv_bits: int = KV_BITS,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    device: str = DEVICE,
) -> None:
    """Measure a model's perplexity on a text: sliding windows, every token scored once."""
    from baselm import perplexity as ppl
    from baselm.backend import select_backend
    from baselm.loader import load_model

    try:
        stride = ppl.default_stride(context) if stride is None else stride
        ppl.check_window(context, stride)
        ppl.check_kv_bits(kv_bits)
        text = ppl.read_text(text_file)
        loaded = load_model(model, select_backend(device))
        token_ids = ppl.encode_text(loaded.tokenizer, text)
        result = ppl.perplexity(loaded.model, token_ids, context, stride, kv_bits, loaded.max_model_len)
    except (ppl.PerplexityError, *user_errors()) as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps({"model": loaded.name, "text": text_file, **result.to_dict()}, indent=2))
        return
    print(
        f"perplexity {result.perplexity:.4f}  (mean NLL {result.mean_nll:.4f} over {result.num_scored} tokens; "
        f"context {result.context}, stride {result.stride}, KV {kv_bits}-bit)"
    )
    print(
        f"{result.num_evaluated} tokens in {result.num_windows} windows, {result.seconds:.1f} s: "
        f"{result.tokens_per_second:.1f} tokens/s"
    )
