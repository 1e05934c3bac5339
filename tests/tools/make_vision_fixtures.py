"""Writes a tiny random Gemma 3 vision-language model and transformers' outputs for it:
tests/fixtures/models/gemma3_vlm/.

Dev tool (needs torch and transformers, which neither the package nor the tests import):

    python tests/tools/make_vision_fixtures.py

The folder holds an HF model folder `base` loads (config.json, model.safetensors in float32, a
small byte-level BPE tokenizer with Gemma 3's control and image tokens, and a Gemma-style chat
template written here), two small images (`image_a.png`: 40x30 RGBA with transparency,
`image_b.jpg`: 50x70), and `reference.npz` with, for a prompt with one image (`_1`) and one with
two (`_2`): transformers' prompt ids (`input_ids_*`), the processor's pixels (`pixel_values_*`,
(num_images, 3, size, size)), the logits of one forward at every position (`logits_*`), and the
ids greedy decoding appends (`greedy_*`). The prompt text is the chat template rendered here with
jinja2 from the same messages the tests send (`MESSAGES_1`, `MESSAGES_2` below, kept equal to
tests/models/test_gemma3_vlm.py's), expanded and encoded by transformers' Gemma3Processor with its
Pillow image processor.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jinja2
import numpy as np
import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    PreTrainedTokenizerFast,
)

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models" / "gemma3_vlm"
SEED = 1234
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
SPECIALS += ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
IMAGE_SIZE, PATCH_SIZE, TOKENS_PER_IMAGE = 32, 4, 16
NUM_GREEDY = 8

CHAT_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
<start_of_turn>{{ role }}
{% if message['content'] is string -%}
{{ message['content'] | trim }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}<start_of_image>
{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}<start_of_turn>model
{% endif -%}"""

MESSAGES_1 = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
COMPARE = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"}, {"type": "image"}]
MESSAGES_2 = [{"role": "user", "content": COMPARE}]

CORPUS = [
    "What is in this picture? Compare the two images with each other.",
    "A cat sits on a red mat. The sky is blue and the grass is green.",
    "Describe the image in one sentence, then list the colours you see.",
    "model user system assistant hello world the a an of in on with and",
] * 4


def make_tokenizer(specials: list[str] = SPECIALS, vocab_size: int = 320, unk_token: str | None = "<unk>") -> Tokenizer:
    """A byte-level BPE trained on CORPUS, `specials` first (ids 0, 1, ...)."""
    tokenizer = Tokenizer(models.BPE(unk_token=unk_token))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def make_images() -> list[Image.Image]:
    rng = np.random.default_rng(SEED)
    y, x = np.mgrid[0:30, 0:40]
    rgba = np.stack([x * 6, y * 8, (x + y) * 3, np.where(x < 20, 255, 96)], axis=-1).astype(np.uint8)
    rgba[..., :3] = np.clip(rgba[..., :3] + rng.integers(0, 20, rgba[..., :3].shape), 0, 255)
    Image.fromarray(rgba, "RGBA").save(OUT / "image_a.png")
    rgb = rng.integers(0, 256, (70, 50, 3), dtype=np.uint8)
    Image.fromarray(rgb, "RGB").save(OUT / "image_b.jpg", quality=90)
    return [Image.open(OUT / "image_a.png"), Image.open(OUT / "image_b.jpg")]


def make_config(vocab_size: int, ids: dict[str, int]) -> Gemma3Config:
    text = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=12, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], rms_norm_eps=1e-6,
        bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE, vision_use_head=False, layer_norm_eps=1e-6,
    )  # fmt: skip
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )


def redraw(model: torch.nn.Module) -> None:
    """Unit-scale weights (LayerNorm/RMSNorm gains near their identity), so outputs are not all near zero."""
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                base = 0.0 if "language_model" in name or "mm_soft_emb_norm" in name else 1.0
                param.copy_(base + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / max(param.shape[-1], 1) ** 0.5)


def render(messages: list, template: str = CHAT_TEMPLATE, **variables: str) -> str:
    """`template` rendered with jinja2 for `messages` and a generation prompt (Gemma's: with its <bos>)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    variables = variables or {"bos_token": "<bos>"}
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, **variables)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    backend = make_tokenizer()
    ids = {t: backend.token_to_id(t) for t in SPECIALS}
    backend.save(str(OUT / "tokenizer.json"))
    config_json = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>",
    }  # fmt: skip
    (OUT / "tokenizer_config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(image_processor, tokenizer, image_seq_length=TOKENS_PER_IMAGE)

    config = make_config(backend.get_vocab_size(), ids)
    model = Gemma3ForConditionalGeneration(config).eval()
    redraw(model)
    model.save_pretrained(OUT, safe_serialization=True)
    for extra in OUT.glob("*.index.json"):
        extra.unlink()
    images = make_images()
    reference = {}
    for tag, messages, pictures in (("1", MESSAGES_1, images[:1]), ("2", MESSAGES_2, images)):
        inputs = processor(text=render(messages), images=pictures, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model(**inputs)
            generated = model.generate(**inputs, max_new_tokens=NUM_GREEDY, do_sample=False, eos_token_id=None)
        reference[f"input_ids_{tag}"] = inputs["input_ids"][0].numpy().astype(np.int32)
        reference[f"pixel_values_{tag}"] = inputs["pixel_values"].numpy().astype(np.float32)
        reference[f"logits_{tag}"] = out.logits[0].numpy().astype(np.float32)
        reference[f"greedy_{tag}"] = generated[0, inputs["input_ids"].shape[1] :].numpy().astype(np.int32)
        greedy = reference[f"greedy_{tag}"].tolist()
        print(tag, "prompt", inputs["input_ids"].shape[1], "greedy", greedy, file=sys.stderr)
    np.savez(OUT / "reference.npz", **reference)
    config_out = json.loads((OUT / "config.json").read_text())
    print("written", sorted(p.name for p in OUT.iterdir()), config_out.get("architectures"), file=sys.stderr)


if __name__ == "__main__":
    main()
