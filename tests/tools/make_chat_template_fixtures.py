"""Renders every chat template llama.cpp ships with transformers; writes the expected texts.

Dev tool: needs `transformers` (and `jinja2`), which the package and the tests never import.

    python tests/tools/make_chat_template_fixtures.py [MODELS_DIR]

MODELS_DIR is llama.cpp's `models/` folder as tests/llama_cpp_files.py extracts it from
llama-cpp-python's sdist (default: under ~/.cache/base/downloads). Each template in
`templates/*.jinja` is rendered with every conversation of tests/tools/chat_template_scenarios.py
through `apply_chat_template` of the `bpe` fixture tokenizer (its special tokens become template
variables, as in base), with strftime_now() pinned. The result, keyed by template file name with
the template's sha256, goes to tests/fixtures/chat_templates/expected.json: the rendered text, or
the error class and message where transformers refuses the conversation.
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import datetime
from pathlib import Path

import transformers
import transformers.utils.chat_template_utils as chat_template_utils
from chat_template_scenarios import NOW, SCENARIOS
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "fixtures" / "chat_templates" / "expected.json"
DEFAULT_MODELS = Path.home() / ".cache" / "base" / "downloads" / "llama-cpp-python-0.3.36" / "models"


class _PinnedClock(datetime):
    @classmethod
    def now(cls, tz=None):  # noqa: ARG003
        return datetime.fromisoformat(NOW)


def render(tokenizer, template: str, scenario: dict) -> dict:
    try:
        text = tokenizer.apply_chat_template(
            scenario["messages"],
            tools=scenario.get("tools"),
            chat_template=template,
            add_generation_prompt=scenario["add_generation_prompt"],
            tokenize=False,
        )
    except Exception as exc:  # the template's own refusal or failure is the expected outcome
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"text": text}


def main() -> None:
    models = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MODELS
    chat_template_utils.datetime = _PinnedClock
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "tests" / "fixtures" / "tokenizers" / "bpe")
    templates = {}
    for path in sorted((models / "templates").glob("*.jinja")):
        template = path.read_text(encoding="utf-8")
        outcomes = {name: render(tokenizer, template, scenario) for name, scenario in SCENARIOS.items()}
        templates[path.name] = {"sha256": hashlib.sha256(template.encode()).hexdigest(), "scenarios": outcomes}
    expected = {
        "transformers": transformers.__version__,
        "now": NOW,
        "scenarios": SCENARIOS,
        "templates": templates,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    failed = sum("error" in o for t in templates.values() for o in t["scenarios"].values())
    print(f"{len(templates)} templates x {len(SCENARIOS)} scenarios -> {OUT} ({failed} refused by transformers)")


if __name__ == "__main__":
    main()
