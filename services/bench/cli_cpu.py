"""`hintserve bench` for the CPU kernels: their weight streaming against memory bandwidth (host-kernels), two
builds side by side (kernel-flags), the quantized matmuls (quant-kernels), and whole models against llama.cpp
(vs-llamacpp)."""

from __future__ import annotations

import argparse
import shlex

from services.bench.cli_args import choices, numbers, require_model


def _quant_kernels(args: argparse.Namespace) -> int:
    from services.bench.quant_kernels import run_quant_kernels

    run_quant_kernels(args.out)
    return 0


def _host_kernels(args: argparse.Namespace) -> int:
    from services.bench.host_kernels import FORMATS, default_threads, run_host_kernels

    formats = choices(args.formats, FORMATS, "--formats")
    if args.min_seconds <= 0 or (args.cycle_mb is not None and args.cycle_mb <= 0):
        raise ValueError("--min-seconds and --cycle-mb must be positive")
    threads = numbers(args.threads, int) if args.threads else default_threads()
    cycle = int(args.cycle_mb * 1e6) if args.cycle_mb else None
    result = run_host_kernels(args.json, formats, numbers(args.rows, int), threads, args.min_seconds, cycle)
    print(f"wrote {args.json} ({len(result['results'])} cases)")
    return 0


def _kernel_flags(args: argparse.Namespace) -> int:
    from services.bench.host_kernels import FORMATS, default_threads
    from services.bench.kernel_flags import KINDS, baseline_flags, run_kernel_flags

    if bool(args.flags) == bool(args.replace_flags):
        raise ValueError("give --flags (added to this machine's build flags) or --replace-flags, not both")
    formats, kinds = choices(args.formats, FORMATS, "--formats"), choices(args.kinds, KINDS, "--kinds")
    if args.rounds < 1 or args.min_seconds <= 0 or (args.cycle_mb is not None and args.cycle_mb <= 0):
        raise ValueError("--rounds must be >= 1 and --min-seconds and --cycle-mb positive")
    candidate = shlex.split(args.replace_flags) if args.replace_flags else baseline_flags() + shlex.split(args.flags)
    threads = numbers(args.threads, int) if args.threads else default_threads()
    cycle = int(args.cycle_mb * 1e6) if args.cycle_mb else None
    result = run_kernel_flags(args.json, candidate, formats, kinds, numbers(args.rows, int), threads, args.rounds,
                              args.min_seconds, cycle)
    print(f"wrote {args.json} ({len(result['results'])} cases)")
    return 0


def _vs_llamacpp(args: argparse.Namespace) -> int:
    from services.bench.llamacpp import llama_importable
    from services.bench.vs_llamacpp import FORMATS, Workload, run_vs_llamacpp

    require_model(args.model)
    formats = choices(args.formats, FORMATS, "--formats")
    if args.rounds < 1 or args.prompt_len < 8 or args.new_tokens < 2 or args.prefill_len < 1:
        raise ValueError("--rounds and --prefill-len must be >= 1, --prompt-len >= 8 and --new-tokens >= 2")
    if not llama_importable(args.llama_python):
        raise ValueError(f"--llama-python: llama_cpp is not importable with {args.llama_python}")
    gguf_dir = args.gguf_dir or args.model.rstrip("/") + "-gguf"
    load = Workload(args.prompt_len, args.new_tokens, args.prefill_len)
    result = run_vs_llamacpp(args.model, args.llama_python, args.llama_cpp_src, gguf_dir, formats,
                             numbers(args.threads, int), args.json, load, args.rounds)
    print(f"wrote {args.json} ({len(result['formats'])} formats, {args.rounds} rounds)")
    return 0


def register(kinds: argparse._SubParsersAction) -> None:
    kernels = kinds.add_parser("quant-kernels", help="weight-only int8/int4 matmul kernels on one demo-model expert")
    kernels.add_argument("--out", default="bench/results", help="folder for quant_kernels.{json,md}")
    kernels.set_defaults(func=_quant_kernels)

    host = kinds.add_parser("host-kernels", help="CPU expert/dense kernels per format: GB/s against a bandwidth probe")
    host.add_argument("--formats", default="fp32,bf16,int8,int4")
    host.add_argument("--rows", default="1,4,16,64", help="tokens per call, e.g. 1,4,16,64")
    host.add_argument("--threads", default=None, help="torch threads, e.g. 1,2 (default 1 .. cores)")
    host.add_argument("--min-seconds", type=float, default=0.3, help="timed seconds per case at least")
    host.add_argument("--cycle-mb", type=float, default=None,
                      help="weight bytes cycled per pass (default twice the last-level cache per thread: DRAM, "
                           "not cache)")
    host.add_argument("--json", default="bench/results/host_kernels.json")
    host.set_defaults(func=_host_kernels)

    flags = kinds.add_parser("kernel-flags", help="two builds of the CPU kernels against each other in one process "
                                                 "(tuning macros, e.g. -DSW_PREFETCH=0)")
    flags.add_argument("--flags", default="", help="added to this machine's build flags, written with '=': --flags=-DPREFETCH_BYTES=2048")
    flags.add_argument("--replace-flags", default="", help="the candidate's whole flag list instead")
    flags.add_argument("--formats", default="int8,int4")
    flags.add_argument("--kinds", default="expert", help="expert, q_proj, o_proj, lm_head (comma-separated)")
    flags.add_argument("--rows", default="1,16", help="tokens per call, e.g. 1,16")
    flags.add_argument("--threads", default=None, help="e.g. 1,2 (default 1 .. cores)")
    flags.add_argument("--rounds", type=int, default=6, help="rounds per case, alternating which build goes first")
    flags.add_argument("--min-seconds", type=float, default=0.2, help="timed seconds per case and build a round")
    flags.add_argument("--cycle-mb", type=float, default=None,
                       help="weight bytes cycled per pass (default twice the last-level cache per thread)")
    flags.add_argument("--json", default="bench/results/kernel_flags.json")
    flags.set_defaults(func=_kernel_flags)

    llama = kinds.add_parser("vs-llamacpp", help="llama.cpp vs hintserve at batch 1, format by format (GGUF)")
    llama.add_argument("--model", required=True,
                       help="HF folder, e.g. from `demo-model build --shape qwen3-30b-a3b --random` (GBs: keep it "
                            "outside the repository)")
    llama.add_argument("--llama-python", required=True, help="interpreter with llama-cpp-python installed")
    llama.add_argument("--llama-cpp-src", default=None,
                       help="llama.cpp source tree (convert_hf_to_gguf.py, gguf-py); needed to convert the GGUFs")
    llama.add_argument("--gguf-dir", default=None, help="where the GGUF files go (default: MODEL-gguf)")
    llama.add_argument("--formats", default="f32,bf16,q8_0,q4_0")
    llama.add_argument("--threads", default="1,2")
    llama.add_argument("--rounds", type=int, default=3, help="rounds, the systems' order flipping each round")
    llama.add_argument("--prompt-len", type=int, default=32)
    llama.add_argument("--new-tokens", type=int, default=64)
    llama.add_argument("--prefill-len", type=int, default=512)
    llama.add_argument("--json", default="bench/results/vs_llamacpp.json")
    llama.set_defaults(func=_vs_llamacpp)
