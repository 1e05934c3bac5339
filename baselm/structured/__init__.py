"""Grammar-constrained decoding (llguidance): JSON objects, JSON Schemas, regexes and Lark grammars
as logits processors the engine runs (grammar.py; json_schemas.py makes schemas end); protocol
layers read request bodies into these. A grammar that cannot be enforced raises
`errors.StructuredOutputError`. Knows nothing of tool calls (baselm/toolcalls builds on it)."""
