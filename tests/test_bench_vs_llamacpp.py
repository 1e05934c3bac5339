"""tests/tools/bench_vs_llamacpp.py's pieces that need no llama.cpp: llama-batched-bench's table, the
files it can name, the bytes a decode step reads, both servers' settings, streams timed through a
loopback server (tests/tools/http_streams.py), server processes, and the three tables."""

from __future__ import annotations

import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.tiny_gguf import encode, write_gguf
from tests.tools.bench_vs_llamacpp import (
    HTTP_PROMPTS,
    BenchError,
    base_serve_command,
    completion_body,
    decode_bytes,
    http_wave,
    llama_server_command,
    parse_batched_bench,
    render,
    resolve_names,
)
from tests.tools.http_streams import ServerError, ServerProcess, StreamTiming, free_port, stream_completion, summarize

# As llama-batched-bench prints it (its log lines go to stderr; the table to stdout).
TABLE = """
main: n_kv_max = 4096, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, n_gpu_layers = -1

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|   128 |     64 |    1 |    192 |    0.412 |   310.68 |    1.901 |    33.67 |    2.313 |    83.01 |
|   128 |     64 |    8 |   1536 |    3.377 |   303.23 |    6.012 |    85.16 |    9.389 |   163.59 |
"""


def test_the_batched_bench_table_reads_as_rows_by_stream_count():
    rows = parse_batched_bench(TABLE)
    assert sorted(rows) == [1, 8]
    assert rows[1]["S_TG t/s"] == 33.67
    assert rows[8]["S_TG t/s"] == 85.16
    assert rows[8]["N_KV"] == 1536


def test_an_unknown_file_name_is_one_clear_error(tmp_path: Path):
    with pytest.raises(BenchError, match="unknown file 'nope'.*smollm2"):
        resolve_names(["nope"], tmp_path)


def test_the_table_gives_base_over_llama_cpp_and_flags_an_isa_not_asked_for():
    llama = {"tg64": 44.0, "tg64_d128": 40.0, "tg8": 80.0, "pp128": 300.0}  # the ratio is against tg64 at depth 128
    run = {"requested_isa": "avx512", "isa": "avx2", "tg1": 50.0, "tg8": 100.0, "pp128": 150.0}
    entry = {"name": "0.5b-q4_k_m", "quant": "Q4_K_M", "llama_cpp": llama, "base": [run]}
    lines = render({"llama_cpp": "0.3.36", "files": [entry]}).splitlines()
    assert lines[2].split() == "0.5b-q4_k_m Q4_K_M avx2(!) 40.0 50.0 1.25 80.0 100.0 1.25 300.0 150.0 0.50".split()
    assert lines[-1].startswith("(!)")


# ---- the bytes a decode step reads -----------------------------------------------------------


def fixture_file(path: Path, with_output: bool) -> Path:
    """A 64-token vocabulary of width 32: the embedding F16 (4096 bytes), one Q8_0 projection (32 rows
    of two 34-byte blocks: 2176 bytes), a float32 norm (128 bytes), and with `with_output` a Q8_0
    output head (64 rows of one block: 2176 bytes)."""
    rng = np.random.default_rng(0)
    tensors = {
        "token_embd.weight": (encode(rng.standard_normal((64, 32), dtype=np.float32), "F16"), "F16"),
        "blk.0.attn_q.weight": (encode(rng.standard_normal((32, 64), dtype=np.float32), "Q8_0"), "Q8_0"),
        "output_norm.weight": (np.ones(32, np.float32), "F32"),
    }
    if with_output:
        tensors["output.weight"] = (encode(rng.standard_normal((64, 32), dtype=np.float32), "Q8_0"), "Q8_0")
    return write_gguf(path, tensors)


def test_a_decode_step_reads_every_tensor_but_the_embedding_a_token_only_looks_up(tmp_path: Path):
    assert decode_bytes(fixture_file(tmp_path / "untied.gguf", with_output=True)) == 2176 + 128 + 2176


def test_a_tied_embedding_is_the_output_head_and_counts_once(tmp_path: Path):
    assert decode_bytes(fixture_file(tmp_path / "tied.gguf", with_output=False)) == 4096 + 2176 + 128


# ---- the servers' settings -------------------------------------------------------------------


def test_both_servers_hold_eight_sequences_of_the_same_length():
    llama = llama_server_command(Path("/bin"), Path("m.gguf"), 8001)
    base = base_serve_command(Path("m.gguf"), 8002)
    assert llama[llama.index("-np") + 1] == "8"
    assert llama[llama.index("-c") + 1] == str(8 * 512)  # llama-server splits -c evenly into its slots
    assert base[base.index("--max-num-seqs") + 1] == "8"
    assert base[base.index("--max-model-len") + 1] == "512"
    assert llama[llama.index("-t") + 1] == "2"


def test_every_prompt_opens_differently_so_no_wave_finds_a_cached_prefix():
    assert len(HTTP_PROMPTS) == 9  # eight for the wave of eight, one for the stream alone
    assert len({prompt.split(".")[0] for prompt in HTTP_PROMPTS}) == 9


# ---- streams through a server ------------------------------------------------------------------

USAGE = {"prompt_tokens": 126, "completion_tokens": 128}
TEXT = [{"choices": [{"index": 0, "text": text, "finish_reason": None}]} for text in ("Once", "", " upon")]
FINISH = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
LLAMA_SERVER_STREAM = [*TEXT, {**FINISH, "usage": USAGE}]  # usage on the finishing chunk
BASE_STREAM = [*TEXT, FINISH, {"choices": [], "usage": USAGE}]  # usage in a chunk of its own


class CannedServer:
    """A loopback server answering GET /health and POST /v1/completions with `chunks` as server-sent
    events (then [DONE]); it keeps the bodies it was sent."""

    def __init__(self, chunks: list[dict]) -> None:
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.end_headers()

            def do_POST(self) -> None:
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in chunks:
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def canned(request):
    server = CannedServer(request.param)
    yield server
    server.close()


@pytest.mark.parametrize("canned", [LLAMA_SERVER_STREAM, BASE_STREAM], ids=["llama-server", "base"], indirect=True)
def test_a_stream_is_timed_from_its_first_text_and_counted_by_the_servers_usage(canned: CannedServer):
    with httpx.Client(trust_env=False) as http:
        timing = stream_completion(http, canned.url, completion_body("Hi", 128))
    assert (timing.prompt_tokens, timing.completion_tokens, timing.finish_reason) == (126, 128, "length")
    assert timing.sent <= timing.first <= timing.last
    assert canned.bodies == [
        {"model": "bench", "prompt": "Hi", "max_tokens": 128, "temperature": 0, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}},
    ]  # fmt: skip


@pytest.mark.parametrize("canned", [[*TEXT, FINISH]], indirect=True)
def test_a_stream_without_the_servers_token_count_is_an_error(canned: CannedServer):
    with httpx.Client(trust_env=False) as http, pytest.raises(ServerError, match="a stream ended without usage"):
        stream_completion(http, canned.url, completion_body("Hi", 128))


@pytest.mark.parametrize("canned", [[*TEXT, {**FINISH, "usage": {**USAGE, "completion_tokens": 100}}]], indirect=True)
def test_a_wave_whose_streams_fall_short_of_128_tokens_fails_loudly(canned: CannedServer):
    with httpx.Client(trust_env=False) as http, pytest.raises(ServerError, match=r"\[100, 100\] tokens, not 128 each"):
        http_wave(http, canned.url, HTTP_PROMPTS[:2])


def test_a_wave_reads_as_decode_speed_after_each_streams_first_token():
    streams = [StreamTiming(0.0, 1.0, 5.0, 126, 128, "length"), StreamTiming(0.0, 1.5, 4.5, 128, 128, "length")]
    assert summarize(streams) == {
        "streams": 2,
        "completion_tokens": 256,
        "prompt_tokens_mean": 127.0,
        "decode_tok_s": 63.5,  # (256 - 2) tokens from the first text (1.0) to the last end (5.0)
        "aggregate_tok_s": 51.2,  # 256 over the 5 s from sending
        "decode_tok_s_per_stream_median": 37.04,  # of 127 / 4 and 127 / 3
        "ttft_mean_ms": 1250.0,
        "ttft_max_ms": 1500.0,
    }


# ---- server processes --------------------------------------------------------------------------


def test_a_server_that_exits_before_it_is_ready_is_an_error_quoting_its_log():
    command = [sys.executable, "-c", "print('error: no such model file'); raise SystemExit(3)"]
    with pytest.raises(ServerError, match=r"(?s)exited with status 3 before it was ready.*no such model file"):
        with ServerProcess("a server", command, free_port(), timeout_s=60):
            pass


HEALTHY = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_server_is_stopped_when_its_block_ends_even_by_an_error():
    port = free_port()
    with pytest.raises(RuntimeError, match="a wave failed"):
        with ServerProcess("a server", [sys.executable, "-c", HEALTHY, str(port)], port, timeout_s=60) as server:
            assert server.is_healthy()
            raise RuntimeError("a wave failed")
    assert server.proc.returncode == -signal.SIGTERM  # ended by stop(), not left running
    assert not server.is_healthy()


# ---- the HTTP and roofline tables ---------------------------------------------------------------


def entry_of(name: str, decode_mib: int, tg64: float, tg1: float) -> dict:
    run = {"requested_isa": "default", "isa": "avx2", "tg1": tg1, "tg8": 2 * tg1, "pp128": 100.0}
    llama = {"tg64": tg64 + 5.0, "tg64_d128": tg64, "tg8": 2 * tg64, "pp128": 100.0}
    quant = name.partition("-")[2].upper()
    return {"name": name, "quant": quant, "decode_bytes": decode_mib * 2**20, "llama_cpp": llama, "base": [run]}


def rows_under(lines: list[str], head: str) -> list[list[str]]:
    """The cells of the rows of the table whose head reads `head` (as words), up to its footer (a line
    of prose: no two spaces in a row, as every line of a table has between its columns)."""
    start = next(i for i, line in enumerate(lines) if line.split() == head.split()) + 2  # past the rule
    end = next(i for i in range(start, len(lines)) if "  " not in lines[i])
    return [line.split() for line in lines[start:end]]


def test_the_http_table_gives_each_wave_of_each_server_and_their_ratio():
    entry = entry_of("0.5b-q4_k_m", 400, 40.0, 50.0)
    waves = lambda tok_s, ttft: [  # noqa: E731
        {"streams": n, "decode_tok_s": t, "ttft_mean_ms": ms} for n, t, ms in zip((1, 8), tok_s, ttft)
    ]
    entry["http"] = {
        "llama_server": waves((40.0, 80.0), (300.0, 2000.0)),
        "base": [{"waves": waves((50.0, 160.0), (250.0, 1500.0))}],
    }
    lines = render({"llama_cpp": "0.3.36", "files": [entry]}).splitlines()
    assert rows_under(lines, "file isa streams llama-server base ratio ttft l.cpp ms base ms") == [
        "0.5b-q4_k_m avx2 1 40.0 50.0 1.25 300 250".split(),
        "0.5b-q4_k_m avx2 8 80.0 160.0 2.00 2000 1500".split(),
    ]


def test_the_roofline_table_runs_from_the_smallest_file_and_gives_each_side_its_share():
    small, large = entry_of("0.5b-q4_0", 200, 60.0, 50.0), entry_of("1.5b-q8_0", 1600, 8.0, 10.0)
    bandwidth_gb_s = 1600 * 2**20 * 12.5 / 1e9  # a roofline of 12.5 tok/s for 1600 MiB, 100 for 200 MiB
    lines = render({"llama_cpp": "0.3.36", "files": [large, small], "bandwidth_gb_s": bandwidth_gb_s}).splitlines()
    assert rows_under(lines, "file quant isa MiB/step roofline tg64@d128 l.cpp of roof base of roof") == [
        "0.5b-q4_0 Q4_0 avx2 200 100.0 60.0 60% 50.0 50%".split(),
        "1.5b-q8_0 Q8_0 avx2 1600 12.5 8.0 64% 10.0 80%".split(),
    ]
