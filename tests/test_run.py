"""`base run` sizes its engine for its one request."""

from __future__ import annotations

from baselm.commands.run import one_request_config


def test_kv_pool_holds_the_prompt_and_max_tokens_in_whole_blocks():
    config = one_request_config(num_prompt_tokens=33, max_tokens=16)
    assert config.max_num_seqs == 1
    assert config.max_model_len == 64  # 49 tokens round up to 4 blocks of 16


def test_no_max_tokens_keeps_the_models_context():
    assert one_request_config(num_prompt_tokens=10, max_tokens=None).max_model_len is None
