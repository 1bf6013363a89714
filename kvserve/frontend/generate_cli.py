"""``kvserve generate``: read prompts (flags, a file, or stdin, one per line) and print completions."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from kvserve.engine.config import parse_tensor_parallel_size


def register(subparsers) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser("generate", help="generate completions offline",
                              description="Generate completions with the offline engine.")
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="treat each prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache memory budget in GiB")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--tensor-parallel-size", type=parse_tensor_parallel_size, default=1, metavar="N|auto",
                   help="ranks of the model (processes on CPU, GPUs on CUDA); --threads is per rank")
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto")
    p.add_argument("--quantization", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantisation of the projections")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not reuse KV blocks across prompts (the prefix cache is on by default)")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file, encoding="utf-8")
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts and not sys.stdin.isatty():
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    return prompts


def run(args) -> int:
    from kvserve.errors import KVServeError
    from kvserve.frontend.llm import LLM
    from kvserve.sampling.params import SamplingParams

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    prompts = _read_prompts(args)
    if not prompts:
        print("kvserve generate: no prompts (use --prompt, --prompts-file or stdin)", file=sys.stderr)
        return 2
    try:
        kv_bytes = int(args.kv_cache_gib * 2**30) if args.kv_cache_gib else None
        llm = LLM(args.model, kv_cache_bytes=kv_bytes, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, num_threads=args.threads,
                  enable_prefix_cache=args.prefix_cache, dtype=args.dtype, quantization=args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size)
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed,
                                stop=args.stop)
        inputs = ([[{"role": "user", "content": p}] for p in prompts] if args.chat
                  else [{"prompt": p} for p in prompts])
        outputs = llm.generate(inputs, params)
    except KVServeError as err:
        print(f"kvserve generate: {err.message}", file=sys.stderr)
        return 1
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                for o in out.outputs]}, ensure_ascii=False))
        else:
            for o in out.outputs:
                print(f"### {prompt}\n{o.text}\n[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]\n")
    return 0
