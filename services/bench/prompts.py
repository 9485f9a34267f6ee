"""Benchmark prompts: GSM8K questions and HumanEval stubs when ../shared is present, else built-in text."""

from __future__ import annotations

import json
import os

from transformers import PreTrainedTokenizerBase

SHARED_PROMPTS = os.path.join(
    os.path.dirname(__file__), "..", "..", "..", "shared", "data", "prompts", "gsm8k_humaneval"
)
_FALLBACK = [
    "Explain how a least recently used cache decides what to evict.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a function that parses a CSV line with quoted fields.",
    "A train leaves at 3 pm travelling 60 miles per hour. When does it cover 150 miles?",
    "import os\n\ndef list_python_files(root):\n",
    "Summarise why mixture-of-experts models route each token to only a few experts.",
    "class Stack:\n    def __init__(self):\n",
    "Tom has 3 boxes with 12 apples each. He gives away 10 apples. How many are left?",
]


def load_texts(limit: int) -> list[str]:
    texts: list[str] = []
    for name, field in (("gsm8k_test.jsonl", "question"), ("humaneval.jsonl", "prompt")):
        path = os.path.join(SHARED_PROMPTS, name)
        if os.path.isfile(path):
            with open(path) as f:
                texts += [json.loads(line)[field] for line in f if line.strip()][: limit // 2 + 1]
    if not texts:
        texts = _FALLBACK * (limit // len(_FALLBACK) + 1)
    # Interleave math and code so every batch mixes both kinds of routing.
    half = len(texts) // 2
    mixed = [t for pair in zip(texts[:half], texts[half:]) for t in pair] or texts
    return mixed[:limit]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, count: int, max_len: int = 64) -> list[list[int]]:
    """`count` prompts as token ids (chat template applied when the tokenizer has one), at most `max_len`."""
    out = []
    for text in load_texts(count):
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(ids[-max_len:])
    return out
