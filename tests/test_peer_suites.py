"""tests/tools/peer_suites.py's counts: a JUnit report's failures sorted by tests/tools/peer/triage.py."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "tests" / "tools" / "peer_suites.py"

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
  <testcase classname="unit.test_chat_completion" name="test_logit_bias"/>
  <testcase classname="unit.test_chat_completion" name="test_apply_chat_template">
    <failure message="assert 404 == 200">...</failure></testcase>
  <testcase classname="unit.test_chat_completion" name="test_chat_completion_stream[Book-8]">
    <failure message="AssertionError: assert '' is None">...</failure></testcase>
  <testcase classname="unit.test_chat_completion" name="test_brand_new">
    <error message="KeyError: 'choices'&#10;more lines">...</error></testcase>
  <testcase classname="unit.test_chat_completion" name="test_slow_one"><skipped message="slow"/></testcase>
</testsuite></testsuites>
"""

UNITTEST_REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
  <testcase classname="test_openai_server.TestOpenAIServer" name="test_penalty"/>
  <testcase classname="test_openai_server.TestOpenAIServerv1Responses" name="test_penalty">
    <failure message="AssertionError: 400 != 200">...</failure></testcase>
  <testcase classname="test_openai_server.TestOpenAIServer" name="test_regex">
    <failure message="JSONDecodeError">...</failure></testcase>
</testsuite></testsuites>
"""


def _script():
    spec = importlib.util.spec_from_file_location("peer_suites", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("peer_suites", module)
    spec.loader.exec_module(module)
    return module


def test_failures_are_sorted_by_the_triage_and_the_rest_count_as_failed(tmp_path):
    peer = _script()
    report = tmp_path / "chat.xml"
    report.write_text(REPORT)
    result = peer.read_report("llamacpp-chat", report)
    counts = {k: result[k] for k in ("passed", "failed", peer.NOT_APPLICABLE, peer.MODEL_LIMITED, "skipped")}
    assert counts == {"passed": 1, "failed": 1, "not applicable": 2, "model-limited": 0, "skipped": 1}
    assert result["failures"]["test_brand_new"] == {"category": "failed", "reason": "KeyError: 'choices'"}
    assert result["failures"]["test_apply_chat_template"]["reason"] == "llama.cpp's /apply-template endpoint"
    assert result["failures"]["test_chat_completion_stream[Book-8]"]["category"] == "not applicable"


def test_a_unittest_class_names_its_tests(tmp_path):
    peer = _script()
    report = tmp_path / "server.xml"
    report.write_text(UNITTEST_REPORT)
    result = peer.read_report("sglang-server", report)
    assert sorted(result["failures"]) == ["TestOpenAIServer::test_regex", "TestOpenAIServerv1Responses::test_penalty"]
    assert result["failures"]["TestOpenAIServer::test_regex"]["category"] == "model-limited"
    assert result["failures"]["TestOpenAIServerv1Responses::test_penalty"]["category"] == "not applicable"
    assert result["passed"] == 1
