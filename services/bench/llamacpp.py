"""llama.cpp's side of `bench vs-llamacpp`: GGUF files made by its own tools, timed through llama-cpp-python.

llama.cpp lives in another virtualenv (`--llama-python`), so everything here runs in subprocesses. The GGUF
files come from llama.cpp's own convert_hf_to_gguf.py (`--llama-cpp-src`: the llama.cpp source tree, e.g. the
`vendor/llama.cpp` folder of llama-cpp-python's sdist), run with our interpreter (it needs torch and
transformers) and its `gguf-py`; Q4_0, which the converter does not write, comes from llama.cpp's quantizer
(`llama_cpp.llama_model_quantize`). Two things are set around the converter, never changed in it: the demo
tokenizer is byte-level BPE with GPT-2's pre-tokenizer, which the converter's table of known tokenizer hashes
cannot know, so its pre-tokenizer is named "gpt-2"; and where `sentencepiece` is missing, the Llama family's
attempt to read a `tokenizer.model` that is not there fails as "not found" (what it does with sentencepiece).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

_CONVERT = r"""
import runpy, sys
from pathlib import Path
script = Path(sys.argv[1])
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
_spm = base.TextModel._create_vocab_sentencepiece
def _create_vocab_sentencepiece(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
    return _spm(self)
base.TextModel._create_vocab_sentencepiece = _create_vocab_sentencepiece
sys.argv = [str(script), *sys.argv[2:]]
runpy.run_path(str(script), run_name="__main__")
"""

_QUANTIZE = r"""
import ctypes, json, sys
import llama_cpp
a = json.loads(sys.argv[1])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = a["ftype"]
params.nthread = a["threads"]
status = llama_cpp.llama_model_quantize(a["src"].encode(), a["dst"].encode(), ctypes.byref(params))
sys.exit(1 if status else 0)
"""

# One (format, threads) case: load, warm up, decode `new_tokens` greedy tokens after `prompt`, then prefill
# `prefill_prompt`; the result is the last stdout line. Logits come straight from the context (no sampler).
_WORKER = r"""
import json, resource, sys, time
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
start = time.perf_counter()
llm = llama_cpp.Llama(model_path=a["gguf"], n_ctx=a["n_ctx"], n_batch=a["n_batch"], n_ubatch=a["n_batch"],
                      n_threads=a["threads"], n_threads_batch=a["threads"], verbose=False)
load_s = time.perf_counter() - start
n_vocab = llm.n_vocab()
def greedy():
    return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).argmax())
def generate(prompt, n):
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    out = [greedy()]
    t1 = time.perf_counter()
    for _ in range(n - 1):
        llm.eval([out[-1]])
        out.append(greedy())
    return out, t1 - t0, time.perf_counter() - t1
generate(a["prompt"][:8], 4)
tokens, ttft, decode = generate(a["prompt"], a["new_tokens"])
llm.reset()
t0 = time.perf_counter()
llm.eval(a["prefill_prompt"])
greedy()
prefill = time.perf_counter() - t0
print(json.dumps({"decode_tok_s": (len(tokens) - 1) / decode, "prefill_tok_s": len(a["prefill_prompt"]) / prefill,
                  "ttft_s": ttft, "load_s": load_s, "tokens": tokens,
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def llama_importable(python: str) -> bool:
    try:
        probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def converter_script(src_dir: str) -> Path:
    script = Path(src_dir) / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(
            f"--llama-cpp-src: no convert_hf_to_gguf.py in {src_dir} (the llama.cpp source tree: e.g. "
            "vendor/llama.cpp in the sdist `pip download --no-binary :all: --no-deps llama-cpp-python` fetches)")
    return script


def run_checked(cmd: list[str], what: str, env: dict | None = None) -> str:
    """stdout of `cmd`; a RuntimeError saying how it ended (exit code or signal) and its output's tail."""
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        code = run.returncode
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise RuntimeError(f"{what} failed ({how}): {(run.stderr or run.stdout).strip()[-2000:]}")
    return run.stdout


def convert(model_dir: str, src_dir: str | None, outtype: str, out: Path) -> Path:
    """`out` written by convert_hf_to_gguf.py --outtype `outtype` (kept if already newer than the weights)."""
    if _fresh(out, model_dir):
        return out
    if src_dir is None:
        raise ValueError(f"{out} is missing: --llama-cpp-src must name llama.cpp's source tree to convert it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    run_checked([sys.executable, "-c", _CONVERT, str(converter_script(src_dir)), model_dir, "--outtype", outtype,
          "--outfile", str(tmp)], f"convert_hf_to_gguf.py --outtype {outtype}")
    tmp.replace(out)
    return out


def quantize(python: str, src: Path, ftype: int, out: Path, threads: int) -> Path:
    """`out` quantized from `src` by llama.cpp's quantizer to `ftype` (a LLAMA_FTYPE_* value)."""
    if _fresh(out, str(src)):
        return out
    tmp = out.with_suffix(".tmp")
    args = json.dumps({"src": str(src), "dst": str(tmp), "ftype": ftype, "threads": threads})
    run_checked([python, "-c", _QUANTIZE, args], f"llama_model_quantize to ftype {ftype}")
    tmp.replace(out)
    return out


def _fresh(out: Path, source: str) -> bool:
    """Whether `out` exists and is newer than `source` (a GGUF file, or a model folder's weights)."""
    if not out.is_file():
        return False
    src = Path(source)
    sources = list(src.glob("*.safetensors")) if src.is_dir() else [src]
    return all(out.stat().st_mtime >= s.stat().st_mtime for s in sources)


def run_llama(python: str, gguf: Path, threads: int, case: dict) -> dict:
    """One timed case in a fresh llama-cpp-python process (`case`: prompt, prefill_prompt, new_tokens,
    n_ctx, n_batch); returns its figures."""
    args = json.dumps({**case, "gguf": str(gguf), "threads": threads})
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    try:
        out = run_checked([python, "-c", _WORKER, args], f"llama.cpp on {gguf.name} ({threads} threads)", env)
    except RuntimeError as exc:
        if "SIGILL" in str(exc):  # seen on a KVM guest with AMX: ggml's AMX kernels (Q8_0, Q4_0) die in tilezero
            raise RuntimeError(f"{exc} [an instruction its ggml build uses is refused here: with AMX, build "
                               "ggml-cpu with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16]") from None
        raise
    return json.loads(out.strip().splitlines()[-1])
