"""Speculative decoding: proposers (n-gram, draft model), the exact acceptance rule, and the
measured rule that decides how many drafts each request verifies (see speculator.py)."""
