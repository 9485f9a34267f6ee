"""No request can stall the others: eight concurrent ~1 MB chat bodies move a victim stream's worst token gap by
less than 100 ms (issue 30: the chat template and tokenizer ran on the gateway's event loop, 0.5-1.2 s per body,
and eight at once froze every stream for 2.3 s). `hintserve serve` runs as its own process, so the clients'
work in this process never competes with it for a GIL."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.live_processes import LiveProcess, hintserve

MODEL = "stall-model"
ATTACKERS = 8
BODY_BYTES = 1_000_000
ALLOWED_ADDED_GAP_S = 0.100
ROUNDS = 3


@pytest.fixture(scope="module")
def serve_url(tiny_mixtral_dir: str) -> Iterator[str]:
    argv = hintserve("serve", "--model", tiny_mixtral_dir, "--model-name", MODEL, "--port", "0",
                     "--max-body-bytes", str(2 << 20))
    process = LiveProcess("serve", argv)
    try:
        yield process.wait_for_line(r"with the OpenAI API at (http://\S+)/v1").group(1)
    finally:
        assert process.stop() == 0, process.output()


# The attackers run in a process of their own: in this one their threads would take the GIL from the thread
# that timestamps the victim's chunks, and the measure would include the clients' own work.
ATTACK = """
import json, sys, time, httpx
from concurrent.futures import ThreadPoolExecutor
url, model, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
filler = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
bodies = [json.dumps({"model": model, "messages": [{"role": "user", "content": f"{i} {filler}"}],
                      "max_tokens": 4}).encode() for i in range(n)]
print("ready", flush=True)
sys.stdin.readline()  # the test says go once the victim streams

def send(body):
    r = httpx.post(url + "/v1/chat/completions", content=body, timeout=60,
                   headers={"content-type": "application/json"})
    return [r.status_code, r.json()["error"]["code"] if r.status_code >= 400 else None]

start = time.monotonic()  # CLOCK_MONOTONIC: the same clock as the test process's
with ThreadPoolExecutor(n) as pool:
    results = list(pool.map(send, bodies))
print(json.dumps({"results": results, "start": start, "end": time.monotonic()}), flush=True)
"""


def _victim_gaps(url: str, attacker: subprocess.Popen | None = None) -> list[tuple[float, float]]:
    """(time, gap since the previous chunk) for each chunk of a streamed completion after the first; with
    `attacker`, it is told to go at the first chunk."""
    body = {"model": MODEL, "prompt": f"Once {uuid.uuid4().hex[:6]}", "max_tokens": 480, "stream": True,
            "ignore_eos": True, "temperature": 0}
    gaps: list[tuple[float, float]] = []
    last = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            if last is None and attacker is not None:
                attacker.stdin.write("go\n")  # type: ignore[union-attr]
                attacker.stdin.flush()  # type: ignore[union-attr]
            if last is not None:
                gaps.append((now, now - last))
            last = now
    return gaps


def _attacked_worst_gap(url: str) -> float:
    """The victim's worst gap among those that end while the attack runs (or just after it), over victim
    streams run back to back until the attack is over."""
    argv = [sys.executable, "-c", ATTACK, url, MODEL, str(ATTACKERS), str(BODY_BYTES)]
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as attacker:
        assert attacker.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        gaps = _victim_gaps(url, attacker)
        while attacker.poll() is None:  # one victim stream is shorter than the attack: more, back to back
            gaps += _victim_gaps(url)
        report = json.loads(attacker.stdout.read())  # type: ignore[union-attr]
    assert report["results"] == [[400, "context_length_exceeded"]] * ATTACKERS
    during = [gap for at, gap in gaps if report["start"] <= at <= report["end"] + ALLOWED_ADDED_GAP_S]
    assert during
    return max(during)


def test_eight_1mb_chat_bodies_do_not_stall_a_victim_stream(serve_url: str) -> None:
    """The best of ROUNDS on both sides: 2 cores shared with other work add scheduling hiccups of their own
    to any single round, while a stall the attack causes (1-2 s before the fix) shows in every round."""
    _victim_gaps(serve_url)  # warm: first-request costs are not the attack's
    baseline = min(max(gap for _, gap in _victim_gaps(serve_url)) for _ in range(ROUNDS))
    under_attack = min(_attacked_worst_gap(serve_url) for _ in range(ROUNDS))
    print(f"victim worst gap (best of {ROUNDS}): alone {baseline * 1000:.1f} ms, "
          f"under attack {under_attack * 1000:.1f} ms")
    assert under_attack - baseline < ALLOWED_ADDED_GAP_S, (baseline, under_attack)


async def test_engine_frontend_refuses_an_oversized_prompt_before_tokenizing(tiny_mixtral_dir: str) -> None:
    """Over gRPC the engine tokenizes text itself (issue 30: a 3.9 MB prompt stalled another stream 2.8 s):
    a prompt longer than the context can hold in any tokenization is refused from its length alone; a long
    one that might fit is tokenized on the worker thread, and then measured in tokens."""
    from services.engine.errors import ContextLengthExceededError
    from services.engine.sampling_params import SamplingParams
    from tests.test_gateway_support import started_engine

    async with started_engine(tiny_mixtral_dir, max_num_seqs=2) as engine:
        limit = engine.config.max_model_len or 512
        huge = "lorem ipsum " * 400_000
        with pytest.raises(ContextLengthExceededError, match="characters"):
            await anext(engine.generate("huge", huge, SamplingParams(max_tokens=4)))
        long = "lorem ipsum " * 500  # past the inline threshold, within the character bound
        assert len(long) <= limit * engine.input_processor.token_chars
        with pytest.raises(ContextLengthExceededError, match="in the prompt"):
            await anext(engine.generate("long", long, SamplingParams(max_tokens=4)))
        fits = "lorem ipsum " * 400
        outs = [o async for o in engine.generate("fits", fits[: limit // 2], SamplingParams(max_tokens=2))]
        assert outs[-1].finished and engine._tokenize_pool is not None
