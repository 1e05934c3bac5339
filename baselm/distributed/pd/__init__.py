"""Prefill/decode disaggregation (`base serve --pd P:D`): prefill ranks compute prompts, decode ranks
take their KV blocks and decode; node.py is one rank, engine.py the engine rank 0 serves from."""
