"""The `base` command line. Heavy modules are imported inside commands so `--help` is instant."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

app = typer.Typer(
    name="base",
    help="base: run LLMs locally on MLX. Chat in the terminal or serve the OpenAI API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEVICE_HELP = "Where to run: auto (GPU when MLX has one), gpu or cpu."


def _fail(message: str, code: int = 1) -> None:
    """Prints one clear error line and exits: user mistakes never show a traceback."""
    from rich.console import Console

    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


def _user_errors() -> tuple[type[Exception], ...]:
    from baselm.backend import BackendError
    from baselm.models.base import ModelConfigError
    from baselm.sampling import SamplingParamsError
    from baselm.store.errors import StoreError
    from baselm.tokenizer import TokenizerError

    return (BackendError, ModelConfigError, SamplingParamsError, StoreError, TokenizerError)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Check this machine: Python, MLX, backend, memory, BLAS, store location."""
    from baselm.doctor import collect, render

    report = collect()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report)


@app.command()
def run(
    model: str = typer.Argument(..., help="Model: a path to an HF model folder or a .gguf file."),
    prompt: str = typer.Argument(..., help="The prompt. Use - to read it from standard input."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling threshold."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the K most likely tokens (0: off)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    raw: bool = typer.Option(False, "--raw", help="Send the prompt as plain text, not through the chat template."),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="Return log-probabilities with the top K alternatives."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    device: str = typer.Option("auto", "--device", help=DEVICE_HELP),
) -> None:
    """Generate once from a prompt and print the answer with its speed."""
    from baselm.run import run_once

    if prompt == "-":
        prompt = sys.stdin.read()
    try:
        run_once(
            model,
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            raw=raw,
            logprobs=logprobs,
            as_json=as_json,
            device=device,
        )
    except _user_errors() as exc:
        _fail(str(exc))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
