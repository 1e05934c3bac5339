"""Writes a tiny random Qwen2.5-VL model and transformers' outputs for it:
tests/fixtures/models/qwen2_5_vl/.

Dev tool (needs torch and transformers, which neither the package nor the tests import):

    python tests/tools/make_qwen2_5_vl_fixture.py

The folder holds an HF model folder `base` loads (config.json with model_type `qwen2_5_vl`,
model.safetensors in float32, preprocessor_config.json with small min_pixels and max_pixels, a
small byte-level BPE tokenizer with Qwen's vision tokens, and a Qwen-style chat template written
here), three images (`image_a.png`: 40x30 RGBA, grown by the min_pixels rule to 40x56;
`image_b.jpg`: 50x70, shrunk by the max_pixels rule to 40x64; `image_c.png`: 100x20, grown to
104x24), and `reference.npz` with, for a prompt with one image (`_1`: A) and one with two (`_2`:
B and C): transformers' prompt ids (`input_ids_*`), the processor's pixels (`pixel_values_*`,
(patches, 3 * 2 * 4 * 4)) and patch grids (`image_grid_thw_*`), the M-RoPE positions transformers
computes (`position_ids_*`, (3, tokens)), the logits of one forward at every position (`logits_*`),
the ids greedy decoding appends (`greedy_*`) and the logits each of its steps saw
(`decode_logits_*`, (8, vocab): they check the positions of generated tokens). The vision tower
has 4 blocks, two with window attention over windows of 2 x 2 merged tokens (uneven at the
image's edges) and two with full attention. The messages are MESSAGES_1 and MESSAGES_2 of make_vision_fixtures.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_idefics3_fixture import make_images, redraw  # noqa: E402
from make_vision_fixtures import MESSAGES_1, MESSAGES_2, NUM_GREEDY, SEED, make_tokenizer, render  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "models" / "qwen2_5_vl"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
SPECIALS += ["<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE, MIN_PIXELS, MAX_PIXELS = 4, 2, 2000, 3000

CHAT_TEMPLATE = """{%- for message in messages -%}
<|im_start|>{{ message['role'] }}
{% if message['content'] is string -%}{{ message['content'] }}
{%- else -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>
{%- elif part['type'] == 'text' -%}{{ part['text'] }}
{%- endif -%}
{%- endfor -%}
{%- endif -%}<|im_end|>
{% endfor -%}
{%- if add_generation_prompt -%}<|im_start|>assistant
{% endif -%}"""


def make_config(vocab_size: int, ids: dict[str, int]) -> Qwen2_5_VLConfig:
    text = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=False,
    )  # fmt: skip
    vision = dict(
        depth=4, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=PATCH,
        spatial_merge_size=MERGE, temporal_patch_size=2, window_size=16, out_hidden_size=64,
        fullatt_block_indexes=[1, 3], hidden_act="silu",
    )  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    backend = make_tokenizer(SPECIALS, vocab_size=400, unk_token=None)
    ids = {t: backend.token_to_id(t) for t in SPECIALS}
    backend.save(str(OUT / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
    }  # fmt: skip
    (OUT / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH, merge_size=MERGE, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
    )
    image_processor.save_pretrained(OUT)
    # The processor's class check asks for its video processor, which needs torchvision; images need none.
    Qwen2_5_VLProcessor.check_argument_for_proper_class = lambda self, name, arg: None
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer)

    model = Qwen2_5_VLForConditionalGeneration(make_config(backend.get_vocab_size(), ids)).eval()
    redraw(model, lambda name: "norm" in name or "ln_q" in name)
    model.save_pretrained(OUT, safe_serialization=True)
    for extra in OUT.glob("*.index.json"):
        extra.unlink()
    images = make_images(OUT)
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
            positions, _ = model.model.get_rope_index(
                inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
            )
            generated = model.generate(
                **inputs, max_new_tokens=NUM_GREEDY, do_sample=False, eos_token_id=None,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        reference[f"input_ids_{tag}"] = inputs["input_ids"][0].numpy().astype(np.int32)
        reference[f"pixel_values_{tag}"] = inputs["pixel_values"].numpy().astype(np.float32)
        reference[f"image_grid_thw_{tag}"] = inputs["image_grid_thw"].numpy().astype(np.int32)
        reference[f"position_ids_{tag}"] = positions[:, 0].numpy().astype(np.int32)
        reference[f"logits_{tag}"] = out.logits[0].numpy().astype(np.float32)
        reference[f"greedy_{tag}"] = generated.sequences[0, inputs["input_ids"].shape[1] :].numpy().astype(np.int32)
        reference[f"decode_logits_{tag}"] = torch.cat(generated.logits).numpy().astype(np.float32)
        print(tag, "prompt", inputs["input_ids"].shape[1], "grids", inputs["image_grid_thw"].tolist(),
              "greedy", reference[f"greedy_{tag}"].tolist(), file=sys.stderr)  # fmt: skip
    np.savez(OUT / "reference.npz", **reference)
    print("written", sorted(p.name for p in OUT.iterdir()), file=sys.stderr)


if __name__ == "__main__":
    main()
