"""Prompt text of a given token length, cut from ShareGPT prompts or synthesised.

With a tokenizer the length is exact: a window of token ids is cut from a pool (the corpus encoded once), decoded,
re-encoded and trimmed or extended until the text encodes to exactly the wanted count (what the server's
tokenizer would count, special tokens included unless `count_special_tokens` is off).

Without a tokenizer the length is an approximation, documented here: synthetic text is common short English
words, each one token in the BPE vocabularies of Llama/Mistral/GPT-style models (1 word ~ 1 token); ShareGPT
text is cut by words at 0.75 words per token (OpenAI's rule of thumb). Expect a few percent error.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from loadgen.trace import REPO_ROOT

SHAREGPT_PATH = REPO_ROOT.parent / "shared" / "data" / "prompts" / "sharegpt" / "ShareGPT_V3_filtered_500.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there one all we their can has more when will would who so no what time said up out if "
    "about into than them only other new some could these two may first then do any like my now over such our "
    "man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three"
).split()
_MAX_FIX_ROUNDS = 32


def load_sharegpt(path: str | Path) -> list[str]:
    """The first human turn of each conversation in a ShareGPT-format JSON list."""
    with open(path) as f:
        data = json.load(f)
    prompts = []
    for item in data:
        turns = item.get("conversations") or []
        text = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
        if text.strip():
            prompts.append(text.strip())
    if not prompts:
        raise ValueError(f"{path}: no prompts found (expected ShareGPT format)")
    return prompts


def load_tokenizer(path: str) -> Any:
    """A local Hugging Face tokenizer (never downloads)."""
    from transformers import AutoTokenizer  # slow import: only when a tokenizer is used

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.model_max_length = 1 << 30  # we only count and cut tokens; never feed a model from here
    return tokenizer


def has_tokenizer(path: str | None) -> bool:
    return path is not None and bool(path) and Path(path).is_dir() and any(
        (Path(path) / f).is_file() for f in TOKENIZER_FILES)


class PromptBuilder:
    """Builds prompts of exact (tokenizer) or approximate (no tokenizer) token lengths from one text corpus."""

    def __init__(self, corpus: list[str], tokenizer: Any = None, seed: int = 0,
                 words_per_token: float = 1.0, count_special_tokens: bool = True) -> None:
        self.rng = random.Random(seed)
        self.tokenizer = tokenizer
        self.words_per_token = words_per_token
        self.count_special_tokens = count_special_tokens
        self.inexact = 0  # prompts whose length could not be made exact
        texts = list(corpus)
        self.rng.shuffle(texts)  # the ShareGPT file order is not random; a seeded shuffle is
        text = "\n\n".join(texts)
        if tokenizer is None:
            self.words = text.split()
        else:
            self.pool: list[int] = tokenizer.encode(text, add_special_tokens=False)
            self.specials = self.count("") if count_special_tokens else 0
        if not (self.words if tokenizer is None else self.pool):
            raise ValueError("empty prompt corpus")

    def count(self, text: str) -> int:
        """Tokens the server would count for `text`."""
        return len(self.tokenizer.encode(text, add_special_tokens=self.count_special_tokens))

    def _window(self, items: list, start: int, n: int) -> list:
        """n items from `start`, wrapping around the pool (prompts longer than the corpus repeat it)."""
        reps = (start + n) // len(items) + 1
        return (items * reps)[start:start + n] if reps > 1 else items[start:start + n]

    def build(self, num_tokens: int) -> str:
        """Prompt text of num_tokens tokens; each call starts at a random pool offset, so prompts differ and
        a server's prefix cache does not turn the replay into a cache benchmark."""
        if num_tokens < 1:
            raise ValueError(f"prompt length must be >= 1, got {num_tokens}")
        if self.tokenizer is None:
            n_words = max(1, round(num_tokens * self.words_per_token))
            return " ".join(self._window(self.words, self.rng.randrange(len(self.words)), n_words))
        best = ("", -1)
        for _ in range(8):  # a different window if one cannot be made exact (rare: odd byte splits)
            text, got = self._exact(self.rng.randrange(len(self.pool)), num_tokens)
            if got == num_tokens:
                return text
            if abs(got - num_tokens) < abs(best[1] - num_tokens):
                best = (text, got)
        # Never fail a whole replay over one length: send the closest and count it (reported as a mismatch).
        self.inexact += 1
        return best[0]

    def _exact(self, start: int, num_tokens: int) -> tuple[str, int]:
        """Decode a window, re-encode, and trim or extend by the difference until the count is exact."""
        want = max(0, num_tokens - self.specials)
        n = want
        text, got = "", self.count("")
        for _ in range(_MAX_FIX_ROUNDS):
            ids = self._window(self.pool, start, n)
            text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            got = self.count(text)
            if got == num_tokens or n <= 0:
                break
            # Re-encoding may merge or split tokens at the edges; move n by the error and retry.
            n = max(0, n + (num_tokens - got))
        return text, got


def make_builder(prompts: str, tokenizer_path: str | None, seed: int = 0,
                 count_special_tokens: bool = True) -> PromptBuilder:
    """`prompts`: 'sharegpt' (the shared ShareGPT file), 'synthetic', or a ShareGPT-format JSON / plain text
    file. tokenizer_path: a local HF tokenizer dir, or None for the approximation."""
    if prompts == "synthetic":
        rng = random.Random(seed)
        corpus = [" ".join(rng.choice(_WORDS) for _ in range(4096))]
        words_per_token = 1.0
    else:
        path = SHAREGPT_PATH if prompts == "sharegpt" else Path(prompts)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file not found: {path} (use --prompts synthetic or a file)")
        corpus = load_sharegpt(path) if path.suffix == ".json" else [path.read_text()]
        words_per_token = 0.75
    tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None
    return PromptBuilder(corpus, tokenizer, seed, words_per_token, count_special_tokens)
