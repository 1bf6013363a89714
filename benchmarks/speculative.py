"""Speculative decoding on vs off, on the same requests, in one process.

    .venv/bin/python benchmarks/speculative.py [--threads 2] [--self-layers 10] [--out FILE]

Three workloads, greedy (so outputs are identical on and off, which is checked):

- ``code_edit_c1``: a real source file and an instruction to rename one function; the
  answer mostly copies the file. One request at a time, n-gram proposer.
- ``chat_c1_self_draft``: chat questions one at a time with the self-draft (the
  model's first ``--self-layers`` layers).
- ``mixed_c32``: 64 requests (half code edits, half chat), 32 running at once, n-gram
  with adaptive control; the figure is the throughput ratio on / off.

For each: output tokens/s on and off and their ratio (wall clock, and per CPU-second
of this process, which other load on the machine moves less), the measured acceptance
``alpha``, drafts per verification ``k``, and the speedup the formula predicts:
tokens per sequence-step ``f * (1 - alpha^(k+1)) / (1 - alpha) + (1 - f)`` (``f`` = share of
sequence-steps that verified drafts) over the measured cost ratio of a sequence-step on / off.
Prints one JSON object (and writes it to ``--out`` if given).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

from kvserve import LLM
from kvserve.sampling.params import SamplingParams
from kvserve.speculative.controller import expected_tokens

CHAT_QUESTIONS = [
    "What is the capital of France, and what is it famous for?",
    "Explain in three sentences why the sky is blue.",
    "Give me a short recipe for pancakes.",
    "What are the main differences between Python lists and tuples?",
    "Write a haiku about autumn leaves.",
    "How does a bicycle stay upright when moving?",
    "List five tips for better sleep.",
    "What is photosynthesis?",
]


def source_files(count: int) -> list[tuple[str, str, str]]:
    """(path, text, a function name in it) for small real source files of this repo."""
    picked = []
    for path in sorted(glob.glob(os.path.join(ROOT, "kvserve", "**", "*.py"), recursive=True)):
        text = open(path).read()
        lines = text.count("\n")
        names = [line.split("def ", 1)[1].split("(", 1)[0] for line in text.splitlines()
                 if line.startswith("def ") and not line.startswith("def _")]
        if 25 <= lines <= 70 and names:
            picked.append((os.path.relpath(path, ROOT), text, names[0]))
    return picked[:count]


def code_edit_conversation(path: str, text: str, name: str) -> list[dict]:
    instruction = (f"Rename the function `{name}` to `{name}_v2` everywhere in this file ({path}). "
                   "Reply with the complete updated file and nothing else.")
    return [{"role": "user", "content": f"{instruction}\n\n```python\n{text}```"}]


def chat_conversation(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def run(llm: LLM, conversations: list, max_tokens: int, one_at_a_time: bool) -> dict:
    """Generate greedily; wall and process-CPU seconds, tokens, steps, outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    steps_before = llm.engine.num_steps
    wall, cpu = time.perf_counter(), time.process_time()
    if one_at_a_time:
        outputs = [llm.chat(c, params)[0] for c in conversations]
    else:
        outputs = llm.chat(conversations, params)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"wall_s": wall, "cpu_s": cpu, "output_tokens": tokens, "steps": llm.engine.num_steps - steps_before,
            "output_tokens_per_s": tokens / wall, "output_tokens_per_cpu_s": tokens / cpu,
            "token_ids": [o.outputs[0].token_ids for o in outputs]}


def compare(name: str, off: dict, on: dict, stats: dict) -> dict:
    """On/off ratios, identity of outputs, and the formula's prediction next to the measurement."""
    alpha, verifications = stats["alpha"], stats["num_verifications"]
    k = stats["num_proposed"] / verifications if verifications else 0.0
    # per sequence-step (one sequence in one step): off, each yields one token; on, one
    # token plus its accepted drafts
    seq_steps_on = on["output_tokens"] - stats["num_accepted"]
    share = verifications / seq_steps_on if seq_steps_on else 0.0           # seq-steps that verified
    per_step = share * expected_tokens(alpha, k) + (1 - share) if verifications else 1.0
    step_cost_ratio = (on["wall_s"] / seq_steps_on) / (off["wall_s"] / off["output_tokens"])
    return {
        "workload": name,
        "outputs_identical": off["token_ids"] == on["token_ids"],
        "off": {k_: v for k_, v in off.items() if k_ != "token_ids"},
        "on": {k_: v for k_, v in on.items() if k_ != "token_ids"},
        "speedup_wall": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        "speedup_cpu": on["output_tokens_per_cpu_s"] / off["output_tokens_per_cpu_s"],
        "alpha": alpha, "drafts_per_verification": k, "share_of_seq_steps_verifying": share,
        "acceptance_rate": stats["acceptance_rate"], "mean_accepted_length": stats["mean_accepted_length"],
        "accepted_per_position": stats["accepted_per_position"],
        "steps_spec_off": stats["num_steps_off"], "steps_spec_on": stats["num_steps_on"],
        "predicted_tokens_per_seq_step": per_step, "measured_tokens_per_seq_step": on["output_tokens"] / seq_steps_on,
        "seq_step_cost_ratio_on_over_off": step_cost_ratio,
        "predicted_speedup": per_step / step_cost_ratio,
        "spec_stats": stats,
    }


def measure(name: str, conversations, max_tokens: int, one_at_a_time: bool, speculative,
            **engine_kwargs) -> dict:
    off_llm = LLM(dtype="float32", **engine_kwargs)
    run(off_llm, conversations[:1], 8, True)                                # warm-up
    off = run(off_llm, conversations, max_tokens, one_at_a_time)
    del off_llm
    on_llm = LLM(dtype="float32", speculative=speculative, **engine_kwargs)
    run(on_llm, conversations[:1], 8, True)
    before = dict(on_llm.spec_stats())
    on = run(on_llm, conversations, max_tokens, one_at_a_time)
    result = compare(name, off, on, _stats_delta(before, on_llm.spec_stats()))   # the measured run only
    result["speculative"] = speculative.method + (f":{speculative.draft_layers}" if speculative.draft_layers else "")
    return result


def _stats_delta(before: dict, after: dict) -> dict:
    delta = {k: after[k] - before[k] for k in ("num_proposed", "num_accepted", "num_verifications",
                                               "num_rejections", "num_steps_on", "num_steps_off")}
    position = after["accepted_per_position"]
    old = before["accepted_per_position"] + [0] * (len(position) - len(before["accepted_per_position"]))
    delta["accepted_per_position"] = [a - b for a, b in zip(position, old)]
    total = delta["num_accepted"] + delta["num_rejections"]
    delta["alpha"] = delta["num_accepted"] / total if total else 0.0
    delta["acceptance_rate"] = delta["num_accepted"] / delta["num_proposed"] if delta["num_proposed"] else 0.0
    delta["mean_accepted_length"] = (delta["num_accepted"] / delta["num_verifications"]
                                     if delta["num_verifications"] else 0.0)
    return delta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--self-layers", type=int, default=10)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--code-files", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    files = source_files(max(args.code_files, 32))
    code = [code_edit_conversation(*f) for f in files]
    common = {"kv_cache_bytes": 1 << 30, "num_threads": args.threads}
    k = args.num_speculative_tokens
    report = {"threads": args.threads, "num_speculative_tokens": k, "results": []}
    report["results"].append(measure("code_edit_c1", code[:args.code_files], 384, True,
                                     _spec("ngram", k), **common))
    report["results"].append(measure("chat_c1_self_draft", [chat_conversation(q) for q in CHAT_QUESTIONS[:4]],
                                     128, True, _spec(f"self:{args.self_layers}", k), **common))
    mixed = [c for pair in zip(code[:32], [chat_conversation(q) for q in CHAT_QUESTIONS * 4]) for c in pair]
    report["results"].append(measure("mixed_c32", mixed, 128, False, _spec("ngram", k),
                                     max_num_seqs=32, **common))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _spec(method: str, k: int):
    from kvserve.speculative.config import SpeculativeConfig
    return SpeculativeConfig.parse(method, num_speculative_tokens=k)


if __name__ == "__main__":
    main()
