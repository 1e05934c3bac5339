"""How a byte-level GGUF vocabulary cuts text into words before BPE: `tokenizer.ggml.pre`.

Each pre-tokenizer name stands for the split of the model's own tokenizer.json: a list of
regular expressions applied one after another (each cuts the pieces the previous one left;
text no expression matches stays a piece of its own), then the GPT-2 byte mapping. Some also
look a whole word up in the vocabulary before merging (`ignore_merges`), as the model's
tokenizer.json says. These are the names llama.cpp's converter writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, pre_tokenizers

from baselm.tokenizer.errors import TokenizerError

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's Tekken and OpenAI's o200k (GPT-4o) split a word at a case change, as their tokenizer.json say.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_WORD_START = r"[^\r\n\p{L}\p{N}]?"


def _cased_words(suffix: str) -> str:
    return f"{_WORD_START}{_UPPER}*{_LOWER}+{suffix}|{_WORD_START}{_UPPER}+{_LOWER}*{suffix}"


_TEKKEN = _cased_words("") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = _cased_words(f"{_CONTRACTIONS}?") + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CJK = r"[一-龥ࠀ-一가-퟿]+"
# DeepSeek LLM's word rule is a list of cased-letter ranges; the cased-letter classes say the same.
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[\p{Lu}\p{Ll}\p{Lt}]+",
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _CJK,
    r"\p{N}+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")


@dataclass(frozen=True, slots=True)
class Split:
    """The regular expressions a vocabulary's text is cut by, in order, and whether whole words skip merging."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in self.patterns]
        return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


_GPT2_SPLIT = Split((_GPT2,))
_DIGITS_GPT2_SPLIT = Split((r"\p{N}", _GPT2))
_LLAMA3_SPLIT = Split((_LLAMA3,), ignore_merges=True)
_QWEN2_SPLIT = Split((_QWEN2,))
_GPT4O_SPLIT = Split((_GPT4O,))

SPLITS: dict[str, Split] = {
    "default": _GPT2_SPLIT,
    "gpt2": _GPT2_SPLIT,
    "gpt-2": _GPT2_SPLIT,
    "phi-2": _GPT2_SPLIT,
    "mpt": _GPT2_SPLIT,
    "olmo": _GPT2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "falcon-h1": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT,
    "midm-2.0": _LLAMA3_SPLIT,
    "lfm2": _LLAMA3_SPLIT,
    "tekken": Split((_TEKKEN,), ignore_merges=True),
    "gpt-4o": _GPT4O_SPLIT,
    "llama4": _GPT4O_SPLIT,
    "kanana2": _GPT4O_SPLIT,
    "minimax-m2": _GPT4O_SPLIT,
    "smaug-bpe": Split((_LLAMA3,)),
    "dbrx": Split((_LLAMA3,)),
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "kormo": _QWEN2_SPLIT,
    "stablelm2": _QWEN2_SPLIT,
    "megrez": _QWEN2_SPLIT,
    "qwen35": Split((_QWEN35,)),
    "smollm": _DIGITS_GPT2_SPLIT,
    "starcoder": _DIGITS_GPT2_SPLIT,
    "refact": _DIGITS_GPT2_SPLIT,
    "command-r": _DIGITS_GPT2_SPLIT,
    "codeshell": _DIGITS_GPT2_SPLIT,
    "exaone": _DIGITS_GPT2_SPLIT,
    "minerva-7b": _DIGITS_GPT2_SPLIT,
    "deepseek-llm": Split(_DEEPSEEK_LLM),
    "deepseek-coder": Split(_DEEPSEEK_CODER),
    "falcon": Split(_FALCON),
}


# Names real GGUFs carry whose split base does not read yet, and the models that carry them: no
# reference tokenization is at hand to check a split of them against (llama.cpp's converter names
# them; its test vocabularies hold none of them).
UNREAD: dict[str, str] = {
    "deepseek-v3": "DeepSeek V3, R1, V3.1, V3.2",
    "superbpe": "OLMo 2 SuperBPE",
    "glm4": "GLM 4, 4.5, 4.7",
    "chatglm-bpe": "ChatGLM / GLM 4 chat",
    "kimi-k2": "Kimi K2",
    "seed-coder": "Seed-Coder",
    "hunyuan": "Hunyuan A13B",
    "hunyuan-dense": "Hunyuan dense",
    "bailingmoe": "Ling",
    "bailingmoe2": "Ling 2",
    "tiny_aya": "Tiny Aya",
    "cohere2moe": "Cohere North",
    "granite-docling": "Granite Docling",
    "exaone4": "EXAONE 4",
}


def byte_level_split(pre: str) -> Split:
    """The split `tokenizer.ggml.pre` names; a TokenizerError naming it (and why) when base does not read it."""
    split = SPLITS.get(pre)
    if split is not None:
        return split
    if pre in UNREAD:
        raise TokenizerError(
            f"GGUF pre-tokenizer {pre!r} ({UNREAD[pre]}) is not supported: base has no reference tokenization "
            "to check its split against yet; convert the model from its HF folder instead"
        )
    raise TokenizerError(
        f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(SPLITS))}); "
        "convert the model from its HF folder instead"
    )
