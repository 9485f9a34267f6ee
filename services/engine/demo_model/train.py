"""Train the demo Mixtral-architecture MoE LM on CPU and save it as a standard Hugging Face directory."""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import MixtralConfig, MixtralForCausalLM

from .tokenizer import BOS_TOKEN, END_TOKEN, PAD_TOKEN, encode_documents, token_id

BUILD_FILE = "demo_model_build.json"

# The shipped shape: 6 layers x 8 experts (top-2), ~24M parameters, ~48 MB in bf16.
DEFAULT_ARCH = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
}


@dataclass
class TrainSettings:
    minutes: float = 8.0  # wall-clock budget for the optimisation loop only
    seed: int = 0
    seq_len: int = 256
    batch_size: int = 0  # 0: measure throughput on a few real steps and pick
    lr: float = 3e-3  # high for a short run; tiny models tolerate it with clipping + warmup
    min_lr_ratio: float = 0.1
    warmup_steps: int = 15  # short: a budget run has only a few hundred steps
    weight_decay: float = 0.1
    chat_fraction: float = 0.25  # oversample chats: ~5% of the text, but the template must be learned
    aux_loss_coef: float = 0.01
    precision: str = "auto"  # auto | bf16 | fp32
    max_steps: int | None = None  # tests: stop after this many steps instead of the time budget
    eval_windows: int = 64
    arch: dict = field(default_factory=dict)  # overrides of DEFAULT_ARCH (tests use a tiny one)
    init_from: str | None = None  # continue training a model this build wrote earlier (same tokenizer)


def model_config(tokenizer: Tokenizer, settings: TrainSettings) -> MixtralConfig:
    """Mixtral config for `tokenizer`; eager experts (the per-expert loop) are fastest on CPU."""
    arch = {**DEFAULT_ARCH, **settings.arch}
    return MixtralConfig(
        vocab_size=tokenizer.get_vocab_size(),
        bos_token_id=token_id(tokenizer, BOS_TOKEN),
        eos_token_id=token_id(tokenizer, BOS_TOKEN),
        pad_token_id=token_id(tokenizer, PAD_TOKEN),
        tie_word_embeddings=False,
        sliding_window=None,
        output_router_logits=True,
        router_aux_loss_coef=settings.aux_loss_coef,
        experts_implementation="eager",
        **arch,
    )


def cpu_has_fast_bf16() -> bool:
    """bf16 autocast only pays on CPUs with native bf16 (AVX512-BF16/AMX); elsewhere it is emulated and slow."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() == "arm64"
    return "avx512_bf16" in flags or "amx_bf16" in flags


class Batches:
    """Random windows from the code and chat token streams, seeded."""

    def __init__(
        self, token_lists: list[list[int]], kinds: list[str], seq_len: int, chat_fraction: float, seed: int
    ):
        self.seq_len = seq_len
        self.streams = {}
        for kind in ("code", "chat"):
            ids = [t for toks, k in zip(token_lists, kinds, strict=True) if k == kind for t in toks]
            if len(ids) > seq_len + 1:
                self.streams[kind] = torch.tensor(ids, dtype=torch.long)
        if not self.streams:
            raise ValueError(f"training text shorter than one window of {seq_len} tokens")
        self.chat_fraction = chat_fraction if "chat" in self.streams and "code" in self.streams else None
        self.gen = torch.Generator().manual_seed(seed)

    def tokens(self) -> int:
        return sum(len(s) for s in self.streams.values())

    def next(self, batch_size: int) -> torch.Tensor:
        rows = []
        for _ in range(batch_size):
            if self.chat_fraction is None:
                stream = next(iter(self.streams.values()))
            else:
                is_chat = torch.rand(1, generator=self.gen).item() < self.chat_fraction
                stream = self.streams["chat" if is_chat else "code"]
            start = int(torch.randint(0, len(stream) - self.seq_len, (1,), generator=self.gen))
            rows.append(stream[start : start + self.seq_len])
        return torch.stack(rows)


def lr_at(step: int, progress: float, s: TrainSettings) -> float:
    """Linear warmup by step, then cosine to min_lr_ratio by progress (fraction of time or steps)."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * cosine)


def train(tokenizer: Tokenizer, train_docs: list, s: TrainSettings) -> tuple[MixtralForCausalLM, dict]:
    """Train a fresh model on `train_docs` for the time budget (or max_steps); returns it and a log."""
    torch.manual_seed(s.seed)
    use_bf16 = s.precision == "bf16" or (s.precision == "auto" and cpu_has_fast_bf16())
    t0 = time.time()
    batches = Batches(
        encode_documents(tokenizer, train_docs),
        [d.kind for d in train_docs],
        s.seq_len,
        s.chat_fraction,
        s.seed,
    )
    encode_s = time.time() - t0
    if s.init_from:
        model = MixtralForCausalLM.from_pretrained(s.init_from, dtype=torch.float32)
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = s.aux_loss_coef
    else:
        model = MixtralForCausalLM(model_config(tokenizer, s))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "embed" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0}],
        lr=s.lr,
        betas=(0.9, 0.95),
        fused=True,  # one kernel per step: the for-each AdamW took ~1 s/step of a ~3.5 s step on 2 cores
    )
    budget = s.minutes * 60
    log: dict = {
        "precision": "bf16-autocast" if use_bf16 else "fp32",
        "encode_s": round(encode_s, 1),
        "train_tokens_available": batches.tokens(),
        "params": sum(p.numel() for p in model.parameters()),
    }
    print(
        f"model: {log['params'] / 1e6:.1f}M parameters; corpus {batches.tokens()} training tokens "
        f"(encoded in {encode_s:.0f}s); precision {log['precision']}",
        flush=True,
    )

    def step(batch_size: int, step_no: int, progress: float) -> tuple[float, float, float]:
        for group in opt.param_groups:
            group["lr"] = lr_at(step_no, progress, s)
        ids = batches.next(batch_size)
        t = time.time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()  # HF adds router_aux_loss_coef * aux_loss to the loss when labels are given
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        aux = out.aux_loss.item()
        return out.loss.item() - s.aux_loss_coef * aux, aux, time.time() - t

    batch_size, step_no, tokens, history = s.batch_size, 0, 0, []
    start = time.time()
    if not batch_size:
        # Real (warmup) steps at a few batch sizes. A budget run is short enough to be limited by the number
        # of steps (loss still near the unigram plateau), so prefer the smaller batch unless clearly faster.
        step(4, step_no, 0.0)
        step_no, tokens = 1, 4 * s.seq_len
        rates = {}
        for bs in (4, 8, 16):
            _, _, dt = step(bs, step_no, 0.0)
            rates[bs] = bs * s.seq_len / dt
            step_no, tokens = step_no + 1, tokens + bs * s.seq_len
        best = max(rates.values())
        batch_size = min(bs for bs, r in rates.items() if r >= 0.8 * best)
        log["throughput_probe_tok_s"] = {str(k): round(v) for k, v in rates.items()}
        print(
            f"throughput probe (tokens/s by batch size): {log['throughput_probe_tok_s']} -> batch {batch_size}"
        )
    total = s.max_steps if s.max_steps else round(budget)
    bar = tqdm(total=total, unit="step" if s.max_steps else "s", mininterval=5, dynamic_ncols=True)
    ema = None
    while True:
        elapsed = time.time() - start
        progress = step_no / s.max_steps if s.max_steps else elapsed / budget
        if progress >= 1.0:
            break
        loss, aux, _ = step(batch_size, step_no, progress)
        step_no, tokens = step_no + 1, tokens + batch_size * s.seq_len
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        bar.n = step_no if s.max_steps else min(round(time.time() - start), total)
        bar.set_postfix(loss=f"{ema:.3f}", aux=f"{aux:.3f}", tok_s=f"{tokens / (time.time() - start):.0f}")
        if step_no % 25 == 0:
            history.append(
                {
                    "step": step_no,
                    "loss_ema": round(ema, 4),
                    "aux": round(aux, 4),
                    "elapsed_s": round(time.time() - start, 1),
                }
            )
            bar.write(f"step {step_no}: loss {ema:.3f} aux {aux:.3f} lr {opt.param_groups[0]['lr']:.2e}")
    bar.close()
    train_s = time.time() - start
    log.update(
        steps=step_no,
        batch_size=batch_size,
        seq_len=s.seq_len,
        tokens_seen=tokens,
        train_s=round(train_s, 1),
        tokens_per_s=round(tokens / train_s),
        final_loss_ema=ema,
        history=history,
    )
    print(f"trained {step_no} steps, {tokens} tokens in {train_s:.0f}s ({tokens / train_s:.0f} tokens/s)")
    model.eval()
    return model, log


def save_model(model: MixtralForCausalLM, tokenizer: Tokenizer, out_dir: Path) -> None:
    """bf16 safetensors (per-expert w1/w2/w3 names), config, generation config; inference defaults."""
    end_id = token_id(tokenizer, END_TOKEN)
    model.config.output_router_logits = False  # inference default, as in Mixtral's own config
    gen = model.generation_config
    gen.bos_token_id = model.config.bos_token_id
    gen.eos_token_id = [model.config.eos_token_id, end_id]  # chat replies end with <|end|>
    gen.pad_token_id = model.config.pad_token_id
    gen._from_model_config = False  # else generate() may rebuild it from config.json and drop <|end|>
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.to(torch.float32)


def write_build_info(out_dir: Path, info: dict) -> None:
    (out_dir / BUILD_FILE).write_text(json.dumps(info, indent=2, default=str) + "\n")


def settings_dict(s: TrainSettings) -> dict:
    return asdict(s)


def verify(out_dir: Path, prompt: str, max_new_tokens: int = 48) -> str:
    """Reload the artefact with transformers (as a user would) and generate a chat reply greedily."""
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    model = MixtralForCausalLM.from_pretrained(out_dir, dtype=torch.float32, experts_implementation="eager")
    text = hf_tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = hf_tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return hf_tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def build(
    out_dir: Path,
    settings: TrainSettings,
    vocab_size: int = 8000,
    max_corpus_mb: float = 20.0,
    prompts_dir: str | Path | None = None,
) -> dict:
    """Corpus -> tokenizer -> train -> save -> reload + generate -> stats. Returns the build info."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out is not a folder: {out_dir}")
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))  # the build box has 2 cores shared with others
    try:
        return _build(out_dir, settings, vocab_size, max_corpus_mb, prompts_dir)
    finally:
        torch.set_num_threads(threads)


def _build(
    out_dir: Path,
    settings: TrainSettings,
    vocab_size: int,
    max_corpus_mb: float,
    prompts_dir: str | Path | None,
) -> dict:
    from .corpus import build_corpus, resolve_prompts_dir
    from .stats import format_table, stats_for_dir
    from .tokenizer import save_tokenizer, train_tokenizer

    t0 = time.time()
    prompts = resolve_prompts_dir(prompts_dir)
    corpus = build_corpus(settings.seed, int(max_corpus_mb * 1e6), prompts)
    print(f"corpus: {corpus.describe()} (prompts: {prompts or 'none'})", flush=True)
    if settings.init_from:  # continuing: keep the earlier build's tokenizer and its build record
        tokenizer = Tokenizer.from_file(str(Path(settings.init_from) / "tokenizer.json"))
        with open(Path(settings.init_from) / "demo_model_build.json") as f:
            previous = json.load(f)
    else:
        tokenizer = train_tokenizer((d.plain_text() for d in corpus.train), vocab_size)
        previous = None
    print(f"tokenizer: {tokenizer.get_vocab_size()} tokens in {time.time() - t0:.0f}s", flush=True)
    model, log = train(tokenizer, corpus.train, settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, out_dir)
    save_model(model, tokenizer, out_dir)
    chats = [d for d in corpus.val if d.kind == "chat"]
    prompt = chats[0].messages[0]["content"] if chats else "Write a Python function that adds two numbers."
    sample = verify(out_dir, prompt)
    print(f"sample chat reply to {prompt[:60]!r}...:\n{sample}", flush=True)
    info = {
        "corpus": {
            "seed": settings.seed,
            "max_corpus_mb": max_corpus_mb,
            "prompts_dir": str(prompts) if prompts else None,
            "summary": corpus.describe(),
            "val_docs": [d.name for d in corpus.val],
        },
        "vocab_size": tokenizer.get_vocab_size(),
        "settings": settings_dict(settings),
        "train": log,
        "sample": {"prompt": prompt, "reply": sample},
        "continued_from": previous,
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "python": platform.python_version(),
        },
    }
    write_build_info(out_dir, info)  # before stats, so `stats` can rebuild the same validation split
    stats = stats_for_dir(out_dir, corpus.val, settings.seq_len, settings.eval_windows)
    print(format_table(stats))
    info["total_s"] = round(time.time() - t0, 1)
    write_build_info(out_dir, info)
    return info
