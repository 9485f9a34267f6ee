"""Byte-level BPE tokenizer for the demo model, saved so `transformers.AutoTokenizer` loads it."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.engine.demo_model.corpus import Document

BOS_TOKEN = EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
END_TOKEN = "<|end|>"  # ends every chat turn; generation stops on it as well as on EOS
SPECIAL_TOKENS = [BOS_TOKEN, PAD_TOKEN, "<|system|>", "<|user|>", "<|assistant|>", END_TOKEN]

# Turns: "<|role|>\n{content}<|end|>\n". The BOS token opens the conversation, like a new document in
# training, so a chat prompt looks to the model exactly like the chats it was trained on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _raise(message: str) -> None:
    raise ValueError(message)


def render_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template rendered as text, exactly as `apply_chat_template(..., tokenize=False)` does."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    template = env.from_string(CHAT_TEMPLATE)
    return template.render(
        messages=list(messages), bos_token=BOS_TOKEN, add_generation_prompt=add_generation_prompt
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8000) -> Tokenizer:
    """Train byte-level BPE; the 256 byte symbols are always in the vocabulary so any text round-trips."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) + 16:
        raise ValueError(f"vocab size {vocab_size} too small for byte-level BPE (need > 300)")
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: the text is encoded verbatim, so decode(encode(x)) == x.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_id(tokenizer: Tokenizer, token: str) -> int:
    """Id of a special token (raises if the tokenizer lacks it)."""
    tid = tokenizer.token_to_id(token)
    if tid is None:
        raise ValueError(f"tokenizer has no token {token!r}")
    return tid


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    """The `tokenizer_config.json` contents (chat template, special tokens, fast tokenizer class)."""
    added = {
        str(token_id(tokenizer, tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS_TOKEN, PAD_TOKEN)],
        "add_bos_token": False,  # the chat template adds it; plain text is encoded verbatim
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "padding_side": "left",  # batched generation
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(tokenizer)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": config["additional_special_tokens"],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def document_text(doc: Document) -> str:
    """A corpus document as the model sees it: BOS then the text, or a chat rendered by the template."""
    if doc.messages:
        return render_chat(doc.messages)
    return BOS_TOKEN + doc.text


def encode_documents(tokenizer: Tokenizer, docs: Sequence[Document]) -> list[list[int]]:
    """Token ids of each document (special tokens in the text are matched as single tokens)."""
    return [enc.ids for enc in tokenizer.encode_batch([document_text(d) for d in docs])]
