"""What the tokenizer fixtures are checked on: the training text, an edge-case corpus, two chat
templates and a set of conversations (read by tests/tools/make_tokenizer_fixtures.py, which writes
the corpus and conversations into tests/fixtures/tokenizers/expected.json).
"""

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox runs away.
Once upon a time there was a small village by the sea. People there fished, sang and told stories.
def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))
In 2024 the population was 1,234,567 and the budget 3.14 million; in 1999 it was 987654.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2048 65536 31415926535.
Café, naïve, résumé, Ångström, façade, jalapeño, über, Straße, crème brûlée.
日本語のテキストです。東京は日本の首都です。中文测试，北京是中国的首都。
Emoji: 😀 😂 👍 🎉 ❤️ and a family 👨‍👩‍👧 on a 🚀.
I'm sure you'll see they've done it; we'd go, she's here, they're there.
<html><body class="main">Hello &amp; welcome</body></html>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
What is the capital of France? Paris is the capital of France. Tell me a story about the sea.
    Indented line with    several     spaces.\tTabs\tand\ttabs.
Line one
Line two

Line four after a blank line.
"""

# Edge cases every tokenizer is checked on: spaces, newlines, tabs, accents, CJK, emoji, digits,
# code, special tokens inside text, and the empty string.
CORPUS = [
    "",
    " ",
    "   ",
    "hello",
    " hello",
    "  hello  world  ",
    "Hello, world!",
    "The capital of France is",
    "line one\nline two\n\n\nline three",
    "\n",
    "\n\n",
    "a\r\nb",
    "\ttabbed\tcolumns\n",
    "    indented code",
    "Café naïve résumé Ångström façade",
    "日本語のテキスト",
    "中文测试，北京",
    "한국어 텍스트",
    "emoji 😀👍🏽 and family 👨‍👩‍👧 🚀",
    "🦜",
    "digits 12345 and 3.14159 and 1,000,000",
    "2024-11-29 08:15:00",
    "31415926535897932384626433832795",
    "def f(x):\n    return x ** 2  # square\n",
    '{"a": [1, 2, {"b": null}]}',
    "<|im_start|>user\nhi<|im_end|>\n",
    "text <|endoftext|> more",
    "<think>reasoning</think> answer",
    "<s> starts [INST] and </s> ends",
    "<unk> token",
    "don't I'll we've THEY'RE",
    "UPPER lower MiXeD",
    "trailing spaces   ",
    "ünïcödé ¿¡ «quotes» — dash … ellipsis",
    "x" * 40,
    "Ⅻ ½ ² ₃ ⁴",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
]

CHATML_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- 'You can call these tools:\\n' }}
{%- for tool in tools %}
{{- tool | tojson(indent=2) + '\\n' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{ raise_exception('A system message must come first.') }}{% endif %}
{%- continue %}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' }}
{%- if message.content is string %}
{{- message.content }}
{%- elif message.content is not none and message.content is defined %}
{%- for part in message.content %}
{%- if part.type == 'text' %}{{ part.text }}{% endif %}
{%- endfor %}
{%- endif %}
{%- if message.tool_calls is defined %}
{%- for call in message.tool_calls %}
{{- '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

INST_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system = none %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant.') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system %}
            {{- '[INST] ' + system + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- else %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city — «météo»",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = {
    "system_user": {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}]},
    "user_only": {"messages": [{"role": "user", "content": "What is 2+2?"}]},
    "multi_turn": {
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one, in 日本語?"},
        ]
    },
    "multi_turn_no_prompt": {
        "messages": [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi there 😀"},
        ],
        "add_generation_prompt": False,
    },
    "tool_call": {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
        ],
        "tools": [WEATHER_TOOL],
    },
    "tool_role": {
        "messages": [
            {"role": "user", "content": "Run it."},
            {"role": "assistant", "content": "Running."},
            {"role": "tool", "content": "exit code 0"},
        ],
    },
    "content_parts": {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}],
            }
        ]
    },
}
