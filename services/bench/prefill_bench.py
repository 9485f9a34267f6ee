"""Long prompts beside running requests, and prompts that share a prefix (`hintserve bench prefill`).

Chunking: requests decode (`--running`, after prompts of `--running-context` tokens); a long prompt arrives.
Per step budget (`--max-num-batched-tokens`): the tokens each decoding request gets while the long prompt
prefills, the median and longest wait between them, and the long prompt's TTFT.
Prefix caching: requests whose prompts share a long prefix, one after another, with `--enable-prefix-caching`
off and on: each later request's prefill seconds. Greedy tokens are kept, and compared across settings.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
from tqdm import tqdm

from services.common.report import bar_plot, markdown_table, run_header, write_json, write_markdown
from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.sampling_params import SamplingParams

QUESTION_TOKENS = 32  # what follows the shared prefix


def _engine(model: str, engine: dict, max_len: int, max_seqs: int = 2, **settings: object) -> LLMEngine:
    out = LLMEngine(EngineConfig(model=model, max_num_seqs=max_seqs, max_model_len=max_len, **engine, **settings),
                    detokenize=False)
    out.generate([[10] * 8], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm
    return out


def chunking_case(model: str, engine: dict, budget: int, prompt: list[int], running_prompts: list[list[int]]
                  ) -> dict:
    """The running requests' tokens and the waits between them while `prompt` prefills, and its TTFT."""
    # The running requests outlast the long prompt's prefill (a token in each of its chunks' steps), and the
    # first of them decode while the later ones prefill: they get those steps' tokens too.
    decode_tokens = 4 + -(-len(prompt) // budget) + 16 + -(-sum(len(p) for p in running_prompts) // budget)
    context = max(len(p) for p in running_prompts) + decode_tokens
    llm = _engine(model, engine, max(len(prompt), context) + 64, len(running_prompts) + 1,
                  max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
    try:
        running = [llm.add_request(f"running{i}", p, params) for i, p in enumerate(running_prompts)]
        while any(r.num_completion_tokens < 4 for r in running):
            llm.step()
        steps_before = llm.stats()["prefill_steps_total"]
        start = time.perf_counter()
        long = llm.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        watched = running[0]  # they all decode in the same steps
        last, seen, waits, ttft = start, watched.num_completion_tokens, [], None
        while long.num_completion_tokens == 0:
            llm.step()
            now = time.perf_counter()
            if watched.num_completion_tokens > seen:
                waits.append(now - last)
                last, seen = now, watched.num_completion_tokens
            if long.num_completion_tokens and ttft is None:
                ttft = now - start
        while llm.has_unfinished():
            llm.step()
        steps = int(llm.stats()["prefill_steps_total"] - steps_before)
    finally:
        llm.close()
    return {"budget": budget, "prompt_tokens": len(prompt), "running": len(running_prompts),
            "running_context": len(running_prompts[0]), "longest_wait_s": max(waits, default=now - start),
            "median_wait_s": statistics.median(waits) if waits else now - start, "long_ttft_s": ttft,
            "prefill_steps": steps, "running_tokens": len(waits), "tokens": long.completion_token_ids}


def prefix_case(model: str, engine: dict, caching: bool, prompts: list[list[int]]) -> dict:
    """Prefill seconds of each request, one after another."""
    llm = _engine(model, engine, max(len(p) for p in prompts) + 16, enable_prefix_caching=caching)
    seconds, tokens = [], []
    try:
        for p in prompts:
            before = llm.stats()["prefill_seconds_total"]
            tokens.append(llm.generate([p], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0])
            seconds.append(llm.stats()["prefill_seconds_total"] - before)
        hits = llm.stats()["prefix_cache_hits_total"]
    finally:
        llm.close()
    return {"caching": caching, "first_prefill_s": seconds[0], "later_prefill_s": statistics.median(seconds[1:]),
            "hit_tokens": hits, "tokens": tokens}


def run_prefill_bench(json_path: str, model: str, engine: dict, budgets: list[int], long_tokens: int,
                      prefix_tokens: int, requests: int = 4, seed: int = 0, running: int = 1,
                      running_context: int = 16) -> dict:
    """running: requests decoding when the long prompt arrives, each after a prompt of running_context tokens
    (mixed steps: every one of them gets a token in each of the long prompt's chunk steps)."""
    vocab = _vocab_size(model)
    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(10, vocab, (n,), generator=gen).tolist()  # past the special tokens

    long = draw(long_tokens)
    running_prompts = [draw(running_context) for _ in range(running)]
    prefix = draw(prefix_tokens)
    prompts = [prefix + draw(QUESTION_TOKENS) for _ in range(requests)]
    chunking, caching = [], []
    with tqdm(total=len(budgets) + 2, desc="bench prefill") as bar:
        for budget in budgets:
            bar.set_postfix_str(f"budget {budget}")
            chunking.append(chunking_case(model, engine, budget, long, running_prompts))
            bar.update()
        for on in (False, True):
            bar.set_postfix_str(f"prefix caching {'on' if on else 'off'}")
            caching.append(prefix_case(model, engine, on, prompts))
            bar.update()
    result = {**run_header(), "model": os.path.basename(os.path.normpath(model)), "engine": engine,
              "chunking": chunking, "prefix_caching": caching,
              "chunking_tokens_identical": all(c["tokens"] == chunking[0]["tokens"] for c in chunking),
              "prefix_tokens_identical": caching[0]["tokens"] == caching[1]["tokens"]}
    _write(json_path, result)
    return result


def _vocab_size(model: str) -> int:
    from services.engine.models.spec import load_hf_config, spec_from_config

    return spec_from_config(load_hf_config(model)).vocab_size


def _write(json_path: str, result: dict) -> None:
    write_json(json_path, result)
    stem = os.path.splitext(json_path)[0]
    chunks = [(c["budget"], c["prompt_tokens"], c["running"], c["running_context"], c["prefill_steps"],
               c["running_tokens"], round(c["median_wait_s"] * 1e3, 1), round(c["longest_wait_s"] * 1e3, 1),
               round(c["long_ttft_s"] * 1e3, 1)) for c in result["chunking"]]
    cached = [("on" if c["caching"] else "off", round(c["first_prefill_s"] * 1e3, 1),
               round(c["later_prefill_s"] * 1e3, 1), int(c["hit_tokens"])) for c in result["prefix_caching"]]
    text = (f"Engine settings: {result['engine']}. Tokens identical across budgets: "
            f"{result['chunking_tokens_identical']}; with and without prefix caching: "
            f"{result['prefix_tokens_identical']}.\n\n"
            + markdown_table(["max_num_batched_tokens", "prompt tokens", "running requests", "their context",
                              "prefill steps", "a running request's tokens meanwhile", "median wait (ms)",
                              "longest wait (ms)", "long prompt's TTFT (ms)"], chunks)
            + "\n\n"
            + markdown_table(["prefix caching", "first request's prefill (ms)", "later requests' prefill (ms)",
                              "prompt tokens from cache"], cached))
    write_markdown(stem + ".md", "Long prompts and shared prefixes", result, text)
    bar_plot(stem + ".png", "A running request's longest wait while a long prompt prefills",
             [str(c["budget"]) for c in result["chunking"]],
             {"seconds": [c["longest_wait_s"] for c in result["chunking"]]}, "seconds")
