"""Writes a tiny random SmolVLM / Idefics3 model and transformers' outputs for it:
tests/fixtures/models/idefics3_vlm/.

Dev tool (needs torch and transformers, which neither the package nor the tests import):

    python tests/tools/make_idefics3_fixture.py

The folder holds an HF model folder `base` loads (config.json with model_type `idefics3`,
model.safetensors in float32, preprocessor_config.json, a small byte-level BPE tokenizer with the
Idefics3 image tokens and `<row_R_col_C>` tags, and a SmolVLM-style chat template written here),
three images (`image_a.png`: 40x30 RGBA with transparency, cut into 2 x 2 tiles and a global view;
`image_b.jpg`: 50x70; `image_c.png`: 100x20, cut into 1 x 2 tiles), and `reference.npz` with, for a
prompt with one image (`_1`: A) and one with two (`_2`: B and C): transformers' prompt ids
(`input_ids_*`), the processor's pixels (`pixel_values_*`, (frames, 3, 32, 32)), the logits of
one forward at every position (`logits_*`) and the ids greedy decoding appends (`greedy_*`). The
messages are MESSAGES_1 and MESSAGES_2 of make_vision_fixtures.py, rendered with jinja2 and expanded
and encoded by transformers' Idefics3Processor with its Pillow image processor.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    PreTrainedTokenizerFast,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_vision_fixtures import MESSAGES_1, MESSAGES_2, NUM_GREEDY, SEED, make_tokenizer, render  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models" / "idefics3_vlm"
ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>"]
SPECIALS += ["<global-img>", *ROW_COL]
TILE, PATCH, SCALE, LONGEST_EDGE = 32, 4, 2, 64
TOKENS_PER_FRAME = (TILE // PATCH // SCALE) ** 2

CHAT_TEMPLATE = """<|im_start|>
{%- for message in messages -%}
{{ message['role'] | capitalize }}
{%- if message['content'] is string -%}: {{ message['content'] }}
{%- else -%}:
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}<image>
{%- elif part['type'] == 'text' -%}{{ part['text'] }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}<end_of_utterance>
{% endfor -%}
{%- if add_generation_prompt -%}Assistant:{% endif -%}"""


def make_images(out: Path = OUT) -> list[Image.Image]:
    """image_a.png (40x30 RGBA), image_b.jpg (50x70), image_c.png (100x20), written to `out`."""
    rng = np.random.default_rng(SEED)
    y, x = np.mgrid[0:30, 0:40]
    rgba = np.stack([x * 6, y * 8, (x + y) * 3, np.where(x < 20, 255, 96)], axis=-1).astype(np.uint8)
    rgba[..., :3] = np.clip(rgba[..., :3] + rng.integers(0, 20, rgba[..., :3].shape), 0, 255)
    Image.fromarray(rgba, "RGBA").save(out / "image_a.png")
    Image.fromarray(rng.integers(0, 256, (70, 50, 3), dtype=np.uint8), "RGB").save(out / "image_b.jpg", quality=90)
    y, x = np.mgrid[0:20, 0:100]
    wide = np.stack([x * 2, y * 12, 255 - x * 2], axis=-1).astype(np.uint8)
    Image.fromarray(wide, "RGB").save(out / "image_c.png")
    return [Image.open(out / name) for name in ("image_a.png", "image_b.jpg", "image_c.png")]


def make_config(vocab_size: int, ids: dict[str, int]) -> Idefics3Config:
    text = dict(
        model_type="llama", vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_theta=10000.0, bos_token_id=ids["<|im_start|>"], eos_token_id=ids["<end_of_utterance>"],
        pad_token_id=ids["<|endoftext|>"], tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=TILE,
        patch_size=PATCH, layer_norm_eps=1e-6,
    )  # fmt: skip
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=SCALE,
        image_token_id=ids["<image>"],
        tie_word_embeddings=False,
    )


def redraw(model: torch.nn.Module, is_norm: Callable[[str], bool] = lambda name: "norm" in name) -> None:
    """Unit-scale weights, so outputs are not all near zero: norm gains (names `is_norm` picks) near
    one, the rest normal over the square root of each row's fan-in."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_norm(name) and name.endswith("weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / max(param[0].numel(), 1) ** 0.5)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    backend = make_tokenizer(SPECIALS, vocab_size=400, unk_token=None)
    ids = {t: backend.token_to_id(t) for t in SPECIALS}
    backend.save(str(OUT / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>",
        "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>", "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    (OUT / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<end_of_utterance>", pad_token="<|endoftext|>"
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}, do_image_splitting=True
    )
    image_processor.save_pretrained(OUT)
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=TOKENS_PER_FRAME)

    model = Idefics3ForConditionalGeneration(make_config(backend.get_vocab_size(), ids)).eval()
    redraw(model)
    model.save_pretrained(OUT, safe_serialization=True)
    for extra in OUT.glob("*.index.json"):
        extra.unlink()
    images = make_images()
    reference = {}
    for tag, messages, pictures in (("1", MESSAGES_1, images[:1]), ("2", MESSAGES_2, images[1:])):
        inputs = processor(
            text=render(messages, CHAT_TEMPLATE, bos_token=""),
            images=pictures,
            add_special_tokens=False,
            return_tensors="pt",
        )
        with torch.no_grad():
            out = model(**inputs)
            generated = model.generate(**inputs, max_new_tokens=NUM_GREEDY, do_sample=False, eos_token_id=None)
        reference[f"input_ids_{tag}"] = inputs["input_ids"][0].numpy().astype(np.int32)
        reference[f"pixel_values_{tag}"] = inputs["pixel_values"][0].numpy().astype(np.float32)
        reference[f"logits_{tag}"] = out.logits[0].numpy().astype(np.float32)
        reference[f"greedy_{tag}"] = generated[0, inputs["input_ids"].shape[1] :].numpy().astype(np.int32)
        print(tag, "prompt", inputs["input_ids"].shape[1], "frames", inputs["pixel_values"].shape[1],
              "greedy", reference[f"greedy_{tag}"].tolist(), file=sys.stderr)  # fmt: skip
    np.savez(OUT / "reference.npz", **reference)
    print("written", sorted(p.name for p in OUT.iterdir()), file=sys.stderr)


if __name__ == "__main__":
    main()
