"""Training text for the demo MoE model, from sources any machine with Python may legally use.

* The Python standard library's own sources (PSF licence): code, comments and docstrings; `pydoc_data`
  carries the language reference text.
* If present, the MIT-licensed GSM8K test questions/answers (as chat conversations, so the model learns the
  chat template) and HumanEval prompts (as code) from ``shared/data/prompts/gsm8k_humaneval``.

Everything is deterministic: sorted file lists, a seeded shuffle, a byte cap, and a validation split made by
whole document so no validation text leaks into training.
"""

from __future__ import annotations

import functools
import json
import random
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_PROMPTS_DIR = REPO_ROOT.parent / "shared" / "data" / "prompts" / "gsm8k_humaneval"
MAX_FILE_BYTES = 512 * 1024  # a few generated tables are huge and would dominate the sample
_SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__", "lib2to3"}
_CALC_ANNOTATION = re.compile(r"<<[^<>]*>>")


@dataclass(frozen=True)
class Document:
    """One training document: plain text ("code") or a chat conversation ("chat")."""

    name: str
    kind: str
    text: str = ""
    messages: tuple[dict[str, str], ...] = field(default_factory=tuple)

    def plain_text(self) -> str:
        """The text content without any template markup (for tokenizer training)."""
        if self.kind == "chat":
            return "\n".join(m["content"] for m in self.messages)
        return self.text

    def size(self) -> int:
        return len(self.plain_text().encode("utf-8"))


@dataclass
class Corpus:
    train: list[Document]
    val: list[Document]

    def describe(self) -> str:
        def summary(docs: list[Document]) -> str:
            chat = sum(1 for d in docs if d.kind == "chat")
            mb = sum(d.size() for d in docs) / 1e6
            return f"{len(docs)} docs ({chat} chat), {mb:.1f} MB"

        return f"train {summary(self.train)}; val {summary(self.val)}"


@functools.lru_cache(maxsize=4)
def stdlib_files(stdlib_dir: Path | None = None) -> list[tuple[str, Path]]:
    """Sorted (relative name, path) of the standard library's *.py files, without third-party packages."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder not found: {root}")
    files = [(p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")]
    return sorted((name, p) for name, p in files if not _SKIP_PARTS.intersection(name.split("/")))


def _read_source(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None  # a few test files are deliberately in other encodings
    return text if text.strip() else None


def gsm8k_messages(question: str, answer: str) -> tuple[dict[str, str], ...]:
    """A GSM8K pair as a chat; calculator annotations dropped, '#### N' made into a sentence."""
    body, _, final = _CALC_ANNOTATION.sub("", answer).rpartition("####")
    reply = f"{body.strip()}\nThe answer is {final.strip()}." if body else answer.strip()
    return ({"role": "user", "content": question.strip()}, {"role": "assistant", "content": reply})


def prompt_documents(prompts_dir: Path) -> list[Document]:
    """GSM8K conversations and HumanEval prompts from `prompts_dir` (files missing there are skipped)."""
    if not prompts_dir.is_dir():
        raise FileNotFoundError(f"prompts folder not found: {prompts_dir}")
    docs: list[Document] = []
    gsm8k = prompts_dir / "gsm8k_test.jsonl"
    if gsm8k.is_file():
        for i, line in enumerate(gsm8k.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                row = json.loads(line)
                docs.append(
                    Document(f"gsm8k/{i}", "chat", messages=gsm8k_messages(row["question"], row["answer"]))
                )
    humaneval = prompts_dir / "humaneval.jsonl"
    if humaneval.is_file():
        for i, line in enumerate(humaneval.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                docs.append(Document(f"humaneval/{i}", "code", text=json.loads(line)["prompt"]))
    return docs


def resolve_prompts_dir(prompts_dir: str | Path | None) -> Path | None:
    """The explicit folder (must exist), else the default one if it exists, else None."""
    if prompts_dir:
        path = Path(prompts_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"--prompts-dir not found: {path}")
        return path
    return DEFAULT_PROMPTS_DIR if DEFAULT_PROMPTS_DIR.is_dir() else None


def build_corpus(
    seed: int = 0,
    max_bytes: int = 20_000_000,
    prompts_dir: Path | None = None,
    val_fraction: float = 0.02,
    stdlib_dir: Path | None = None,
) -> Corpus:
    """Stdlib sources (shuffled, capped at `max_bytes` in all) plus the prompt data; split by document."""
    if max_bytes <= 0:
        raise ValueError("corpus size cap must be positive")
    rng = random.Random(seed)
    prompt_docs = prompt_documents(prompts_dir) if prompts_dir else []
    budget = max_bytes - sum(d.size() for d in prompt_docs)
    if budget < max_bytes // 2:
        # A tiny cap (tests): keep at least half the budget for stdlib code, subsample the prompts.
        rng.shuffle(prompt_docs)
        kept, used = [], 0
        for doc in prompt_docs:
            if used + doc.size() > max_bytes // 2:
                break
            kept.append(doc)
            used += doc.size()
        prompt_docs, budget = kept, max_bytes - used
    files = list(stdlib_files(stdlib_dir))  # a copy: the cached list must not be shuffled in place
    rng.shuffle(files)
    code_docs: list[Document] = []
    for name, path in files:
        try:
            size = path.stat().st_size  # UTF-8 bytes on disk: check the cap before reading
        except OSError:
            continue
        if size > MAX_FILE_BYTES:
            continue
        text = _read_source(path) if size <= budget or budget < 4096 else None
        if text is None:
            continue
        size = len(text.encode("utf-8"))  # newline translation may shrink it
        if size > budget:
            break  # budget nearly used up
        code_docs.append(Document(f"stdlib/{name}", "code", text=text))
        budget -= size
    docs = code_docs + prompt_docs
    rng.shuffle(docs)
    # Split per kind so the (small) chat set is represented in validation too.
    train: list[Document] = []
    val: list[Document] = []
    for kind in ("code", "chat"):
        of_kind = [d for d in docs if d.kind == kind]
        n_val = max(1, round(len(of_kind) * val_fraction)) if len(of_kind) >= 2 else 0
        val += of_kind[:n_val]
        train += of_kind[n_val:]
    if not train or not val:
        raise ValueError("corpus too small to split into training and validation documents")
    return Corpus(train=train, val=val)
