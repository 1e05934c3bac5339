"""Grammar-constrained decoding (llguidance): JSON objects, JSON Schemas, regexes and Lark grammars
as logits processors the engine runs; protocol layers read request bodies into these."""
