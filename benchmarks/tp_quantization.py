"""Weight quantisation under tensor parallelism: SmolLM2-135M at TP=3 against TP=1, same scheme.

Greedy tokens of 8 prompts of the test prompt set (chat and long raw prompts), 16 each, fp32
activations, ``--quantization int8`` (or ``int4``): how many prompts give TP=1's tokens exactly,
and the largest difference of the chosen tokens' logprobs along the common prefix. TP=3 is the
split SmolLM2's 9 heads allow; the ranks share this machine's cores.

    .venv/bin/python benchmarks/tp_quantization.py [--scheme int8] [--out benchmarks/tp_quantization.json]

Prints one JSON object.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_host import emit  # noqa: E402


def greedy_outputs(path: str, prompts, tp: int, scheme: str):
    from kvserve import LLM
    from kvserve.sampling.params import SamplingParams
    llm = LLM(path, dtype="float32", kv_cache_bytes=2**27, tensor_parallel_size=tp, num_threads=1,
              quantization=scheme)
    try:
        return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2))
    finally:
        llm.engine.close()


def compare(ref, got) -> dict:
    """Prompts with identical tokens, the worst chosen-token logprob gap on common prefixes, and
    the reference's top-2 gap where a prompt diverges."""
    identical, worst, gaps = 0, 0.0, []
    for a, b in zip(ref, got):
        identical += a.outputs[0].token_ids == b.outputs[0].token_ids
        for ta, tb, la, lb in zip(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                  a.outputs[0].logprobs, b.outputs[0].logprobs):
            if ta != tb:
                top = sorted(la.values(), reverse=True)
                gaps.append(round(top[0] - top[1], 4))
                break
            worst = max(worst, abs(la[ta] - lb[tb]))
    return {"prompts": len(ref), "identical": identical, "worst_logprob_diff": round(worst, 4),
            "top2_gap_at_divergence": gaps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scheme", default="int8", choices=["int8", "int4"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from kvserve.loader import default_model_path
    from kvserve.tokenizer import Tokenizer
    from tests.support.prompt_set import build_prompts
    path = default_model_path()
    prompts = [{"prompt_token_ids": p} for p in build_prompts(Tokenizer.load(path))[:16:2]]
    ref = greedy_outputs(path, prompts, 1, args.scheme)
    got = greedy_outputs(path, prompts, 3, args.scheme)
    emit({"benchmark": "tp_quantization", "model": "SmolLM2-135M-Instruct", "scheme": args.scheme,
          "tp": 3, "tokens": 16, **compare(ref, got)}, args.out)


if __name__ == "__main__":
    main()
