"""llama.cpp and `base bench` side by side on the same GGUF files, on this machine's CPU.

    .venv/bin/python -m tests.tools.bench_vs_llamacpp [--quick] [--files NAME,...|PATH.gguf,...]
                                                      [--isa default,avx2,...] [--http] [--roofline]
                                                      [--cache DIR] [--json]

The first run builds llama.cpp from the `llama-cpp-python` sdist (about 11 minutes on 2 cores) into
`~/.cache/base/llama.cpp/<version>-<hash>/` (`--cache DIR` puts it elsewhere) and makes the test files,
random-weight Qwen2.5-0.5B- and 1.5B-shaped GGUFs quantized by `llama-quantize` to Q4_0, Q4_K_M,
Q5_K_M, Q6_K and Q8_0, each only when asked for: see tests/tools/llamacpp_build.py. `--files` takes
their names (`0.5b-q4_k_m`, `1.5b-q8_0`, ...), `smollm2` (base's default model) or any GGUF path;
`--quick` is `0.5b-q4_k_m,smollm2`; the default is all of them.

Per file, llama.cpp and base run one after the other, 2 threads each:
`llama-bench -m F -p 128 -n 64 -d 0,128 -t 2 -o json` (pp128; tg64 after 0 and after 128 cached
tokens), `llama-batched-bench -m F -c 4096 -npp 128
-ntg 64 -npl 1,8 -t 2` (S_TG at 8 streams), then `base bench F --concurrency 1,8 --prompt-tokens 128
--gen-tokens 64 --json` once per `--isa` (`BASE_CPU_ISA`; `default` leaves it unset). The ISA base
reports it ran (its `matmuls` line) is the one printed. It prints one row per file and ISA: llama.cpp's
tg64 at depth 128, base's 1-stream decode tok/s and their ratio (both decode 64 tokens after 128 in the
cache, as the 8 streams do on both sides: on SmolLM2 tg64 from an empty cache runs about 10% faster
than at depth 128, and so does base from a one-token prompt; plain tg64 is kept in the JSON);
llama.cpp's S_TG at 8 streams, base's 8-stream
aggregate decode and ratio; pp128 of each and ratio. A ratio is base / llama.cpp (above 1: base is
faster). `--json` prints the whole report instead.

`--http` then puts the two servers side by side, one at a time, each on a free loopback port and
stopped however its turn ends (a server that does not start fails with its log's tail):
`llama-server -m F -np 8 -c 4096 -t 2` (8 slots of 512 tokens) and, once per ISA, `base serve F
--max-num-seqs 8 --max-model-len 512 --runaway-guard 0`. Each gets a warm-up request, then one stream
alone, then 8 at once: streaming `/v1/completions` of 128 tokens (greedy, `ignore_eos`) on fixed
~128-token prompts that open differently (no stream finds another's prompt cached). A wave's decode
speed is its streams' tokens after their first, over the time from the first text of any stream to the
end of the last; the counts are the servers' own (`usage`), and a stream that did not make all 128 is
an error. A second table gives, per file, ISA and wave, each server's decode tok/s, their ratio and
the mean time to first token (see tests/tools/http_streams.py, shared with scripts/bench_http.py).

`--roofline` measures the read bandwidth once, as `base bench --synthetic` does (its
`stream_bandwidth`: a plain read of 512 MiB by the kernels' threads), and prints a third table, smallest
file first: the bytes a decode step reads, the roofline `bandwidth / bytes` in tok/s, and llama.cpp's
tg64 and base's 1-stream decode with their share of it. A step reads every tensor of the file once (the
matrices in their quantized blocks, norms and biases), except the token embedding, of which it looks up
one row per token; when the file has no `output.weight` the embedding is also the output head, read
whole by its matmul, and counts once. The KV cache is left out: at these contexts (under 200 tokens)
it is under 1% of a Qwen2.5-shaped file's bytes, but some 5-8% of SmolLM2's (92 MiB; 30 layers of
192-wide K and V, float16 in llama.cpp, float32 in base on the CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import httpx

from baselm.store.default_model import base_home
from tests.tools.http_streams import ServerError, ServerProcess, free_port, stream_completion, summarize
from tests.tools.llamacpp_build import (
    MADE,
    THREADS,
    VERSION,
    BenchError,
    build_llama_cpp,
    make_file,
    native_hash,
    quant_of,
    resolve_names,
    run_tool,
)

ISAS = ("default", "avx512", "avx2", "generic")
QUICK = ("0.5b-q4_k_m", "smollm2")
DEPTH = 128  # tokens in the cache when the 1-stream decode is timed: base bench's prompt, batched-bench's npp


@dataclass(frozen=True, slots=True)
class BenchFile:
    name: str  # "0.5b-q4_k_m", "smollm2" or the file's stem
    quant: str  # "Q4_K_M": from the file's general.file_type
    path: Path


# ---------------------------------------------------------------------------------------------
# The benchmarks


def parse_json(out: str, program: str) -> dict | list:
    """The JSON `program` printed (after any log lines), or a BenchError quoting what it printed."""
    start = min((i for i in (out.find("{"), out.find("[")) if i >= 0), default=0)
    try:
        return json.loads(out[start:])
    except ValueError:
        raise BenchError(f"{program} printed no JSON: {out.strip()[-200:]!r}") from None


def llama_bench(bins: Path, path: Path, timeout_s: float) -> dict[str, float | str]:
    """llama-bench's pp128 and tg64 from an empty cache and tg64 after 128 cached tokens (tok/s, mean
    of its repetitions), and which build ran."""
    cmd = [str(bins / "llama-bench"), "-m", str(path), "-p", "128", "-n", "64", "-d", f"0,{DEPTH}"]
    rows = parse_json(run_tool([*cmd, "-t", str(THREADS), "-o", "json"], timeout_s), "llama-bench")

    def find(n_prompt: int, n_gen: int, depth: int) -> dict:
        wanted = (n_prompt, n_gen, depth)
        row = next((r for r in rows if (r["n_prompt"], r["n_gen"], r.get("n_depth", 0)) == wanted), None)
        if row is None:
            raise BenchError(f"llama-bench reported no pp{n_prompt}/tg{n_gen} at depth {depth} for {path.name}")
        return row

    pp, tg, tg_deep = find(128, 0, 0), find(0, 64, 0), find(0, 64, DEPTH)
    build = f"{tg['build_commit']} ({tg['cpu_info']})"
    return {"pp128": pp["avg_ts"], "tg64": tg["avg_ts"], "tg64_d128": tg_deep["avg_ts"], "build": build}


def parse_batched_bench(table: str) -> dict[int, dict[str, float]]:
    """llama-batched-bench's markdown table as {B: {column: value}}, e.g. {8: {"S_TG t/s": 41.2, ...}}."""
    rows, header = {}, None
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header is not None and len(cells) == len(header) and all(re.fullmatch(r"[\d.]+", c) for c in cells):
            row = dict(zip(header, map(float, cells)))
            rows[int(row["B"])] = row
    return rows


def batched_bench(bins: Path, path: Path, timeout_s: float) -> dict[int, float]:
    """llama-batched-bench's S_TG (aggregate decode tok/s) at 1 and 8 streams."""
    cmd = [str(bins / "llama-batched-bench"), "-m", str(path), "-c", "4096", "-npp", "128", "-ntg", "64"]
    rows = parse_batched_bench(run_tool([*cmd, "-npl", "1,8", "-t", str(THREADS)], timeout_s))
    if 8 not in rows:
        raise BenchError(f"llama-batched-bench printed no row for 8 streams on {path.name}")
    return {b: row["S_TG t/s"] for b, row in rows.items()}


def base_program() -> str:
    """The `base` of this environment (beside its python), else the one on PATH."""
    return shutil.which("base", path=str(Path(sys.executable).parent)) or "base"


def isa_env(isa: str) -> dict[str, str]:
    """This process's environment with BASE_CPU_ISA=`isa` ("default": unset)."""
    env = {k: v for k, v in os.environ.items() if k != "BASE_CPU_ISA"}
    if isa != "default":
        env["BASE_CPU_ISA"] = isa
    return env


def base_bench(path: Path, isa: str, timeout_s: float) -> dict[str, float | str]:
    """`base bench`'s 1- and 8-stream decode and 1-stream prefill (tok/s) under BASE_CPU_ISA=`isa`, and
    the ISA its kernels report they ran (an unknown ISA falls back to the widest)."""
    cmd = [base_program(), "bench", str(path), "--concurrency", "1,8", "--prompt-tokens", "128", "--gen-tokens", "64"]
    out = run_tool([*cmd, "--json"], timeout_s, env=isa_env(isa))
    report = parse_json(out, "base bench")
    if not report["matmuls"].startswith("base CPU kernels"):  # a comparison of MLX's own ops says nothing
        raise BenchError(f"base ran without its CPU kernels: {report['matmuls']}")
    by_streams = {row["concurrency"]: row for row in report["throughput"]}
    ran = re.search(r"\((\w+), \d+ threads", report["matmuls"])
    return {
        "isa": ran.group(1) if ran else report["matmuls"],
        "tg1": by_streams[1]["decode_tok_s_aggregate"],
        "tg8": by_streams[8]["decode_tok_s_aggregate"],
        "pp128": by_streams[1]["prefill_tok_s"],
        "matmuls": report["matmuls"],
    }


def bench_file(file: BenchFile, bins: Path, isas: list[str], timeout_s: float, http: bool = False) -> dict:
    """llama.cpp's two benchmarks, then base once per ISA, on one file; with `http`, then llama-server
    and `base serve` (once per ISA) through HTTP. Every entry says the bytes a decode step reads."""
    print(f"{file.name}: llama-bench, llama-batched-bench", file=sys.stderr)
    llama = llama_bench(bins, file.path, timeout_s)
    llama["tg8"] = batched_bench(bins, file.path, timeout_s)[8]
    runs = []
    for isa in isas:
        print(f"{file.name}: base bench (BASE_CPU_ISA={isa})", file=sys.stderr)
        runs.append({"requested_isa": isa, **base_bench(file.path, isa, timeout_s)})
    entry = {**asdict(file), "path": str(file.path), "decode_bytes": decode_bytes(file.path)}
    entry |= {"llama_cpp": llama, "base": runs}
    if http:
        entry["http"] = http_bench(file, bins, isas, timeout_s)
    return entry


# ---------------------------------------------------------------------------------------------
# Through HTTP: `llama-server -np 8` against `base serve`, the same streams to each

HTTP_STREAMS = 8  # sequences each server holds at once; waves of 1 and of 8 streams
HTTP_GEN_TOKENS = 128
SEQ_LEN = 512  # one sequence's context in both servers: a ~128-token prompt and 128 tokens, with room
SERVER_START_S = 300
OPENINGS = (
    "The lighthouse keeper wrote in her log before dawn.",
    "Rain came in from the west over the low hills.",
    "The copper works stood at the edge of the river town.",
    "Autumn had turned the beech wood red and gold.",
    "The tea merchant opened his shop at eight each morning.",
    "A bicycle leaned against the bakery wall in the square.",
    "The beekeeper lifted the lid of the oldest hive.",
    "Snow lay on the roofs and the stars were out early.",
    "The ferry left the harbour an hour behind its time.",
)
PASSAGE = (
    "Along the coast the fishing boats came home one by one, and the people of the town walked down"
    " to the quay to meet them, as they had done for as long as anyone could remember. Children ran"
    " between the nets, the gulls circled and called above the masts, and an old man sat on an upturned"
    " crate mending a sail with a bone needle. Later the lamps were lit along the sea wall, the market"
    " stalls were packed away, and the smell of bread and smoke drifted up the narrow streets toward the"
    " church on the hill."
)
# About 128 tokens each in Qwen2's and SmolLM2's tokenizers; each opens differently, so that no stream
# finds another's prompt in a prefix cache. The last one is the 1-stream wave's.
HTTP_PROMPTS = tuple(f"{opening} {PASSAGE}" for opening in OPENINGS)


def llama_server_command(bins: Path, path: Path, port: int) -> list[str]:
    ctx = HTTP_STREAMS * SEQ_LEN  # split evenly into the -np slots
    cmd = [str(bins / "llama-server"), "-m", str(path), "-np", str(HTTP_STREAMS), "-c", str(ctx)]
    return [*cmd, "-t", str(THREADS), "--host", "127.0.0.1", "--port", str(port)]


def base_serve_command(path: Path, port: int) -> list[str]:
    """`base serve` holding 8 sequences of SEQ_LEN tokens, as llama-server's slots; no runaway guard,
    which could cut a greedy stream of random weights short where llama-server has none."""
    cmd = [base_program(), "serve", str(path), "--port", str(port), "--device", "cpu", "--no-webui"]
    cmd += ["--max-num-seqs", str(HTTP_STREAMS), "--max-model-len", str(SEQ_LEN), "--runaway-guard", "0"]
    return [*cmd, "--served-model-name", "bench"]


def completion_body(prompt: str, max_tokens: int) -> dict:
    """Greedy, never stopped by an end-of-sequence token: every stream makes `max_tokens` tokens."""
    return {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def http_wave(http: httpx.Client, url: str, prompts: tuple[str, ...]) -> dict:
    """One stream per prompt, all at once, summarized; a ServerError where one was not HTTP_GEN_TOKENS long."""
    body = lambda prompt: completion_body(prompt, HTTP_GEN_TOKENS)  # noqa: E731
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda prompt: stream_completion(http, url, body(prompt)), prompts))
    counts = [s.completion_tokens for s in streams]
    if any(n != HTTP_GEN_TOKENS for n in counts):
        raise ServerError(f"its {len(prompts)} streams generated {counts} tokens, not {HTTP_GEN_TOKENS} each")
    return summarize(streams)


def http_waves(server: ServerProcess, timeout_s: float) -> list[dict]:
    """A warm-up request, then one stream alone and HTTP_STREAMS at once (on prompts not sent before);
    a ServerError quoting the server's log where a request failed or fell short."""
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as http:
            stream_completion(http, server.url, completion_body("Hello", 4))
            alone = http_wave(http, server.url, HTTP_PROMPTS[-1:])
            return [alone, http_wave(http, server.url, HTTP_PROMPTS[:HTTP_STREAMS])]
    except (httpx.HTTPError, ServerError) as exc:
        raise server.fail(f"{server.name}: {exc}") from None


def http_bench(file: BenchFile, bins: Path, isas: list[str], timeout_s: float) -> dict:
    """The waves through llama-server, then through `base serve` once per ISA; one server at a time,
    each stopped however its waves end."""
    print(f"{file.name}: llama-server -np {HTTP_STREAMS}", file=sys.stderr)
    port = free_port()
    with ServerProcess("llama-server", llama_server_command(bins, file.path, port), port, None, SERVER_START_S) as s:
        llama = http_waves(s, timeout_s)
    runs = []
    for isa in isas:
        print(f"{file.name}: base serve (BASE_CPU_ISA={isa})", file=sys.stderr)
        port = free_port()
        with ServerProcess("base serve", base_serve_command(file.path, port), port, isa_env(isa), SERVER_START_S) as s:
            runs.append({"requested_isa": isa, "waves": http_waves(s, timeout_s)})
    return {"llama_server": llama, "base": runs}


# ---------------------------------------------------------------------------------------------
# Against the memory roofline

LOOKED_UP = frozenset({"token_embd.weight", "position_embd.weight", "token_types.weight"})


def decode_bytes(path: Path) -> int:
    """Bytes of the GGUF at `path` that one decode step reads: every tensor whole (matrices in their
    blocks as stored, norms, biases), except tables a step only looks a row up in (the token and
    position embeddings). The token embedding is also the output head when the file has no
    `output.weight` (tied): the head's matmul reads it whole, so it then counts, once.
    NOTE: the KV cache is left out (see the module's docstring for how much that is)."""
    tensors = gguf.GGUFReader(str(path)).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(int(t.n_bytes) for t in tensors if t.name not in LOOKED_UP or (tied and t.name == "token_embd.weight"))


def read_bandwidth() -> float:
    """Bytes/s of a plain read of memory by base's kernel threads, as `base bench --synthetic` measures it."""
    import mlx.core as mx

    from baselm.backend import select_backend
    from baselm.commands.bench_synthetic import stream_bandwidth

    backend = select_backend("cpu")
    if not backend.cpu_kernels:
        raise BenchError("base's CPU kernels are not available here (see `base doctor`): no roofline without them")
    bandwidth = stream_bandwidth(backend)
    mx.clear_cache()  # the 512 MiB it read goes back before the benchmarks
    return bandwidth


# ---------------------------------------------------------------------------------------------
# The report


def ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}" if theirs else "-"


def aligned(rows: list[tuple[str, ...]], num_left: int) -> list[str]:
    """`rows` (the head first) in columns, the first `num_left` aligned left and the rest right, with a
    rule under the head."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i < num_left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    lines = [line(row) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def shown_isa(run: dict) -> str:
    """The ISA base ran, marked (!) where it is not the one asked for."""
    return run["isa"] if run["requested_isa"] in ("default", run["isa"]) else f"{run['isa']}(!)"


def render(report: dict) -> str:
    """One row per file and ISA: llama.cpp / base / ratio for tg64, 8-stream decode and pp128; then the
    HTTP table and the roofline table where the report holds them."""
    head = ("file", "quant", "isa", "tg64@d128 l.cpp", "base", "ratio", "8-str l.cpp", "base", "ratio")
    head += ("pp128 l.cpp", "base", "ratio")
    rows = [head]
    for entry in report["files"]:
        llama = entry["llama_cpp"]
        for run in entry["base"]:
            row = (entry["name"], entry["quant"], shown_isa(run))
            for key in ("tg1", "tg8", "pp128"):
                theirs = llama["tg64_d128" if key == "tg1" else key]
                row += (f"{theirs:.1f}", f"{run[key]:.1f}", ratio(run[key], theirs))
            rows.append(row)
    lines = aligned(rows, 3)
    lines.append(f"llama.cpp {report['llama_cpp']}, {THREADS} threads each; ratio = base / llama.cpp")
    if any("http" in entry for entry in report["files"]):
        lines += ["", *render_http(report["files"])]
    if "bandwidth_gb_s" in report:
        lines += ["", *render_roofline(report["files"], report["bandwidth_gb_s"])]
    lines += [f"{name}: {why}" for name, why in report.get("failed", {}).items()]
    if any("(!)" in row[2] for row in rows):
        lines.append("(!): base ran another ISA than asked for (BASE_CPU_ISA names one this CPU lacks)")
    return "\n".join(lines)


def render_http(files: list[dict]) -> list[str]:
    """One row per file, ISA and wave: aggregate decode tok/s and mean time to first token of each server."""
    rows = [("file", "isa", "streams", "llama-server", "base", "ratio", "ttft l.cpp ms", "base ms")]
    for entry in (e for e in files if "http" in e):
        llama = entry["http"]["llama_server"]
        for bench_run, run in zip(entry["base"], entry["http"]["base"]):
            for theirs, ours in zip(llama, run["waves"]):
                rows.append((entry["name"], shown_isa(bench_run), str(ours["streams"]), f"{theirs['decode_tok_s']:.1f}",
                             f"{ours['decode_tok_s']:.1f}", ratio(ours["decode_tok_s"], theirs["decode_tok_s"]),
                             f"{theirs['ttft_mean_ms']:.0f}", f"{ours['ttft_mean_ms']:.0f}"))  # fmt: skip
    lines = aligned(rows, 2)
    lines.append(
        f"through HTTP: llama-server -np {HTTP_STREAMS} and base serve --max-num-seqs {HTTP_STREAMS}, one at a time;"
    )
    lines.append(f"streams of {HTTP_GEN_TOKENS} greedy tokens (ignore_eos), decode tok/s summed over the streams")
    return lines


def render_roofline(files: list[dict], bandwidth_gb_s: float) -> list[str]:
    """One row per file and ISA, smallest first: bytes a decode step reads, the roofline they set and
    each side's 1-stream decode against it."""
    rows = [("file", "quant", "isa", "MiB/step", "roofline", "tg64@d128 l.cpp", "of roof", "base", "of roof")]
    for entry in sorted(files, key=lambda e: e["decode_bytes"]):
        roof = bandwidth_gb_s * 1e9 / entry["decode_bytes"]
        theirs = entry["llama_cpp"]["tg64_d128"]
        for run in entry["base"]:
            rows.append((entry["name"], entry["quant"], shown_isa(run), f"{entry['decode_bytes'] / 2**20:.0f}",
                         f"{roof:.1f}", f"{theirs:.1f}", f"{100 * theirs / roof:.0f}%", f"{run['tg1']:.1f}",
                         f"{100 * run['tg1'] / roof:.0f}%"))  # fmt: skip
    lines = aligned(rows, 3)
    lines.append(f"roofline tok/s = {bandwidth_gb_s:.2f} GB/s read (as base bench --synthetic measures it) / MiB/step:")
    lines.append("the bytes a decode step reads (every tensor; the token embedding only where it is the output head)")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", help=f"comma-separated: {', '.join(MADE)}, smollm2 or GGUF paths (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--isa", default="default", help=f"comma-separated BASE_CPU_ISA values: {', '.join(ISAS)}")
    parser.add_argument("--cache", type=Path, help="where llama.cpp and the test files are kept")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds each benchmark may run")
    parser.add_argument("--http", action="store_true", help=f"also llama-server -np {HTTP_STREAMS} against base serve")
    parser.add_argument("--roofline", action="store_true", help="also decode against the measured memory roofline")
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    isas = args.isa.split(",")
    if unknown := [isa for isa in isas if isa not in ISAS]:
        raise BenchError(f"unknown --isa {', '.join(unknown)}: choose from {', '.join(ISAS)}")
    names = list(QUICK) if args.quick else args.files.split(",") if args.files else [*MADE, "smollm2"]
    cache = args.cache or base_home() / "llama.cpp" / f"{VERSION}-{native_hash()}"
    files = resolve_names(names, cache)
    bins = build_llama_cpp(cache)
    report = {"llama_cpp": VERSION, "cache": str(cache), "threads": THREADS, "files": [], "failed": {}}
    if args.roofline:
        report["bandwidth_gb_s"] = round(read_bandwidth() / 1e9, 2)
        print(f"read bandwidth: {report['bandwidth_gb_s']} GB/s", file=sys.stderr)
    for name, path in files:
        try:
            if name in MADE:
                make_file(name, bins, cache)
            entry = bench_file(BenchFile(name, quant_of(path), path), bins, isas, args.timeout, args.http)
        except (BenchError, ServerError) as exc:  # one file's failure does not cost the others' numbers
            print(f"{name}: {exc}", file=sys.stderr)
            report["failed"][name] = str(exc)
            continue
        report["files"].append(entry)
        report["llama_cpp"] = f"{VERSION} {entry['llama_cpp']['build']}"
        rows = render({**report, "files": [entry]}).splitlines()[2 : 2 + len(isas)]
        print("\n".join(rows), file=sys.stderr)  # so far, in case a later file never finishes
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        report = run(args)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(report, indent=2) if args.json else render(report))


if __name__ == "__main__":
    main()
