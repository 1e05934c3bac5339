"""Tracing a model's `sanitize` tells which file rows or columns each row or column of its weights is."""

from __future__ import annotations

import numpy as np

from baselm.distributed.tp.trace import trace_sources
from baselm.models import model_class
from baselm.store.base_reader import BaseFile
from tests.distributed.test_tp_read import _base


def _traced(tmp_path, fixture: str, quant: str = "q4"):
    base = BaseFile.open(_base(tmp_path, fixture, quant))
    config = base.header["config"]
    args_cls, model_cls = model_class(config["model_type"])
    return trace_sources(model_cls(args_cls.from_dict(config)), base.tensors), config


def test_phi3_q_k_v_and_gate_up_rows_are_row_ranges_of_the_fused_tensors(tmp_path):
    trace, config = _traced(tmp_path, "phi3")
    d = config["head_dim"]
    q_rows, kv_rows, inter = config["num_attention_heads"] * d, config["num_key_value_heads"] * d, 64
    qkv, gate_up = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
    starts = {
        "self_attn.q_proj": (qkv, 0, q_rows),
        "self_attn.k_proj": (qkv, q_rows, kv_rows),
        "self_attn.v_proj": (qkv, q_rows + kv_rows, kv_rows),
        "mlp.gate_proj": (gate_up, 0, inter),
        "mlp.up_proj": (gate_up, inter, inter),
    }
    for layer, (name, start, rows) in starts.items():
        source = trace.sources[(f"layers.1.{layer}", -2)]
        assert source.names == (name,) and source.file_axis == -2 and source.lead == ()
        assert source.indices.tolist() == [list(range(start, start + rows))], layer
    down = trace.sources[("layers.1.mlp.down_proj", -1)]
    assert down.names == ("model.layers.1.mlp.down_proj.weight",) and down.indices.tolist() == [list(range(inter))]
    assert trace.uses[qkv] == {
        f"layers.1.{layer}.weight" for layer in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    }


def test_gpt_oss_expert_rows_are_columns_of_the_stacked_transposed_file_tensor(tmp_path):
    trace, config = _traced(tmp_path, "gpt_oss", "f32")
    inter = config["intermediate_size"]
    gate_up = trace.sources[("layers.0.mlp.experts.gate_up_proj", -2)]
    assert gate_up.names == ("model.layers.0.mlp.experts.gate_up_proj",)
    assert gate_up.file_axis == -1 and gate_up.lead == ()  # the file holds the experts' axis itself
    assert gate_up.indices.tolist() == [list(range(2 * inter))]  # gate and up interleaved, as stored
    down = trace.sources[("layers.0.mlp.experts.down_proj", -1)]
    assert down.names == ("model.layers.0.mlp.experts.down_proj",) and down.file_axis == -2
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" not in {n for s in trace.sources.values() for n in s.names}


def test_per_expert_tensors_stacked_at_load_give_one_source_per_expert(tmp_path):
    trace, config = _traced(tmp_path, "mixtral")
    source = trace.sources[("layers.0.mlp.experts.down_proj", -1)]
    num_experts = config["num_local_experts"]
    assert source.lead == (num_experts,)
    assert source.names == tuple(f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in range(num_experts))
    assert np.array_equal(source.indices, np.tile(np.arange(64), (num_experts, 1)))  # widened to 64 features


def test_rows_interleaved_from_two_tensors_are_not_traced(tmp_path):
    trace, _ = _traced(tmp_path, "gpt_oss_split", "f32")  # gate and up experts as two tensors
    assert ("layers.0.mlp.experts.gate_up_proj", -2) not in trace.sources
    assert ("layers.0.mlp.experts.down_proj", -1) in trace.sources
