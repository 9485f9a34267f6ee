"""The soak (`make soak`, not in CI): the fault suite's cluster under N concurrent streams for a duration;
reports failures and each process's memory (RSS) growth after warm-up.

    python -m tests.soak --duration-s 600 --concurrency 32 --out bench/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

from tests.conftest import DEMO_MODEL_DIR
from tests.fault_cluster import Cluster, Outcome, stream_once


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def soak(duration_s: float, concurrency: int, max_tokens: int, sample_every_s: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as work:
        cluster = Cluster(str(DEMO_MODEL_DIR), Path(work))
        cluster.start()
        try:
            return _run(cluster, duration_s, concurrency, max_tokens, sample_every_s)
        finally:
            codes = cluster.stop()
            print(f"exit codes: {codes}")


def _run(cluster: Cluster, duration_s: float, concurrency: int, max_tokens: int, every_s: float) -> dict[str, object]:
    names = ["gateway", "engine0", "engine1", "predictor", "redis"]
    pids = {n: cluster.processes[n].proc.pid for n in names}
    samples: list[tuple[float, dict[str, float]]] = []
    outcome = Outcome()
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s
    start = time.monotonic()

    def worker() -> None:
        while time.monotonic() < deadline:
            result = stream_once(cluster.gateway_url, max_tokens)
            with lock:
                outcome.add(result)

    with ThreadPoolExecutor(concurrency) as pool, tqdm(total=int(duration_s), unit="s", desc="soak") as bar:
        for _ in range(concurrency):
            pool.submit(worker)
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - start, {n: rss_mb(p) for n, p in pids.items()}))
            time.sleep(min(every_s, max(0.0, deadline - time.monotonic())))
            bar.update(int(time.monotonic() - start) - bar.n)
            bar.set_postfix(sent=outcome.sent, failed=outcome.sent - outcome.ok)
    samples.append((time.monotonic() - start, {n: rss_mb(p) for n, p in pids.items()}))
    warm = next((s for t, s in samples if t >= 0.2 * duration_s), samples[0][1])  # after warm-up (caches, arenas)
    last = samples[-1][1]
    return {
        "duration_s": duration_s,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "requests": outcome.as_dict() | {"unclear": outcome.unclear[:10]},
        "rss_mb_after_warmup": {n: round(warm[n], 1) for n in names},
        "rss_mb_at_end": {n: round(last[n], 1) for n in names},
        "rss_growth_mb": {n: round(last[n] - warm[n], 1) for n in names},
        "rss_growth_pct": {n: round(100 * (last[n] - warm[n]) / warm[n], 1) if warm[n] else 0.0 for n in names},
        "samples": [(round(t, 1), {n: round(v, 1) for n, v in s.items()}) for t, s in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.soak")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sample-every-s", type=float, default=10.0)
    parser.add_argument("--out", default="bench/results/soak.json")
    args = parser.parse_args()
    report = soak(args.duration_s, args.concurrency, args.max_tokens, args.sample_every_s)
    Path(args.out).write_text(json.dumps(report, indent=2))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
