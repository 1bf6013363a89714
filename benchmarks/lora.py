"""Multi-LoRA throughput: many adapters batched together vs base-only traffic vs one
adapter at a time, plus adapter load and swap times. One process, one engine, the same
requests for every configuration, measured in the same run.

    .venv/bin/python benchmarks/lora.py [--requests 64] [--max-tokens 64] [--threads 1]
                                        [--targets all|attn|qv] [--out benchmarks/lora.json]

Adapters: PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's
tensor names) of rank 8 on ``--targets``, random A and B from a per-adapter seed, so every
adapter is distinct (tests/model/test_lora_parity.py checks the format against peft).
Traffic: ``--requests`` prompts of real source text, greedy, ``--max-tokens`` each, all
arriving at once, ``max_num_seqs`` = 32 (and, for k = 16 and base-only, 64: every request at
once, the engine's default). Each request's adapter is drawn uniformly or by
a power law (Zipf, s = 1.1) over ``k`` adapters, k in 1, 4, 16, 64; 16 resident slots,
so k = 64 pages adapters through the slots and (with a host tier of 32) through disk.

Baselines in the same run: base-only traffic on the same engine, and the naive
alternative at k = 16: the same requests served one adapter at a time (per-adapter
batches, one after another). Ratios are of output tokens per second of wall time;
tokens per CPU-second of this process are reported too (less moved by other load).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

TARGETS = {"all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           "attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "qv": ("q_proj", "v_proj")}
SLOTS, HOST, RANK = 16, 32, 8


def make_adapters(model_config, folder: str, count: int, targets: tuple[str, ...]) -> list[str]:
    """``count`` distinct PEFT folders of rank RANK on ``targets`` of every layer."""
    from safetensors.torch import save_file

    from kvserve.lora.peft_format import module_shape
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"a{i}")
        os.makedirs(path)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": list(targets),
                       "bias": "none", "lora_dropout": 0.0}, f)
        gen, tensors = torch.Generator().manual_seed(i), {}
        for layer in range(model_config.num_layers):
            for module in targets:
                out_dim, in_dim = module_shape(model_config, module)
                part = "self_attn" if module in TARGETS["attn"] else "mlp"
                name = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, in_dim, generator=gen) / in_dim ** 0.5
                tensors[f"{name}.lora_B.weight"] = torch.randn(out_dim, RANK, generator=gen) * 0.02
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        paths.append(path)
    return paths


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    import email.message, textwrap  # noqa: E401  real text
    corpus = "\n".join(inspect.getsource(m) for m in (textwrap, email.message))
    ids = tokenizer.encode(corpus, add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(32, 256)
        start = rng.randint(0, len(ids) - length - 1)
        prompts.append(ids[start:start + length])
    return prompts


def assign(num_requests: int, k: int, popularity: str, seed: int = 0) -> list[int]:
    """Adapter index of each request: uniform round robin or Zipf(s=1.1) over k."""
    if popularity == "uniform":
        return [i % k for i in range(num_requests)]
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** 1.1 for rank in range(k)]
    return rng.choices(range(k), weights=weights, k=num_requests)


def run(llm, prompts, loras, max_tokens: int) -> dict:
    """One generate call over every prompt; tokens/s of wall and of this process's CPU."""
    from kvserve.sampling.params import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "tokens_per_cpu_s": round(tokens / cpu, 1), "outputs": [o.outputs[0].token_ids for o in outputs]}


def one_adapter_at_a_time(llm, prompts, loras, max_tokens: int) -> dict:
    """The naive alternative: per-adapter batches, one after another."""
    groups: dict[str, list[int]] = {}
    for i, lora in enumerate(loras):
        groups.setdefault(lora.name, []).append(i)
    tokens, wall, cpu = 0, 0.0, 0.0
    outputs: list = [None] * len(prompts)
    for indices in groups.values():
        result = run(llm, [prompts[i] for i in indices], [loras[i] for i in indices], max_tokens)
        tokens += result["output_tokens"]
        wall += result["seconds"]
        cpu += result["output_tokens"] / result["tokens_per_cpu_s"]
        for i, out in zip(indices, result["outputs"]):
            outputs[i] = out
    return {"output_tokens": tokens, "seconds": round(wall, 2), "tokens_per_s": round(tokens / wall, 1),
            "tokens_per_cpu_s": round(tokens / cpu, 1), "outputs": outputs, "num_batches": len(groups)}


def load_and_swap_times(llm, paths: list[str]) -> dict:
    """disk -> host (read, check, digest) through the engine's load, and host -> resident
    slot (the copy into the stacked tensors), p50 / p99 in ms."""
    manager = llm.engine.adapters
    disk, swap = [], []
    for i, path in enumerate(paths):
        t = time.perf_counter()
        llm.engine.load_adapter(f"timing{i}", path)
        disk.append(time.perf_counter() - t)
        weights = manager._host[manager.resolve(f"timing{i}")]
        adapter_bytes = weights.nbytes
        t = time.perf_counter()
        manager.slots.write(SLOTS - 1, weights)
        swap.append(time.perf_counter() - t)
        llm.engine.unload_adapter(f"timing{i}")
    manager.slots.clear(SLOTS - 1)

    def pct(values, q):
        return round(statistics.quantiles(values, n=100)[q - 1] * 1e3, 2)
    return {"disk_to_host_ms": {"p50": pct(disk, 50), "p99": pct(disk, 99)},
            "host_to_slot_ms": {"p50": pct(swap, 50), "p99": pct(swap, 99)},
            "adapter_bytes": adapter_bytes,
            "slot_bytes": manager.slots.slot_nbytes, "samples": len(paths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--targets", choices=sorted(TARGETS), default="all")
    parser.add_argument("--adapters", default="1,4,16,64")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from kvserve import LLM, LoRARequest
    from kvserve.loader import default_model_path
    model_path = default_model_path()
    ks = [int(k) for k in args.adapters.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        llm = LLM(model_path, dtype="float32", enable_lora=True, max_loras=SLOTS, max_cpu_loras=HOST,
                  max_lora_rank=RANK, max_num_seqs=32, num_threads=args.threads, kv_cache_bytes=512 * 2**20)
        paths = make_adapters(llm.engine.model_config, folder, max(ks), TARGETS[args.targets])
        prompts = make_prompts(llm.tokenizer, args.requests)
        run(llm, prompts[:4], None, 4)                                      # warm-up
        results = {"base_only": run(llm, prompts, None, args.max_tokens)}
        for k in ks:
            for popularity in ("uniform", "power_law") if k > 1 else ("uniform",):
                loras = [LoRARequest(f"a{j}", paths[j]) for j in assign(len(prompts), k, popularity)]
                results[f"k{k}_{popularity}"] = run(llm, prompts, loras, args.max_tokens)
                results[f"k{k}_{popularity}"]["distinct_adapters"] = len({lora.name for lora in loras})
        k16 = [LoRARequest(f"a{j}", paths[j]) for j in assign(len(prompts), 16, "uniform")]
        results["k16_one_adapter_at_a_time"] = one_adapter_at_a_time(llm, prompts, k16, args.max_tokens)
        exact = results["k16_one_adapter_at_a_time"]["outputs"] == results["k16_uniform"]["outputs"]
        timings = load_and_swap_times(llm, paths)
        counters = llm.engine.stats().adapters
        del llm
        # the same k = 16 traffic with every request running at once (the engine's default
        # max_num_seqs): the one-at-a-time baseline's batches do not change
        wide = LLM(model_path, dtype="float32", enable_lora=True, max_loras=SLOTS, max_cpu_loras=HOST,
                   max_lora_rank=RANK, max_num_seqs=64, num_threads=args.threads, kv_cache_bytes=512 * 2**20)
        run(wide, prompts[:4], None, 4)
        results["k16_uniform_64_at_once"] = run(wide, prompts, k16, args.max_tokens)
        results["base_only_64_at_once"] = run(wide, prompts, None, args.max_tokens)
    for name, result in results.items():
        result.pop("outputs")
        base = results["base_only_64_at_once" if name.endswith("64_at_once") else "base_only"]["tokens_per_s"]
        result["ratio_vs_base_only"] = round(result["tokens_per_s"] / base, 3)
    naive = results["k16_one_adapter_at_a_time"]["tokens_per_s"]
    report = {
        "benchmark": "lora", "threads": args.threads, "requests": args.requests, "max_tokens": args.max_tokens,
        "adapter": {"rank": RANK, "targets": list(TARGETS[args.targets])}, "resident_slots": SLOTS,
        "host_tier": HOST, "cpu": _cpu_name(), "results": results,
        "batched_vs_one_at_a_time_k16": round(results["k16_uniform"]["tokens_per_s"] / naive, 3),
        "batched_64_at_once_vs_one_at_a_time_k16": round(
            results["k16_uniform_64_at_once"]["tokens_per_s"] / naive, 3),
        "one_at_a_time_outputs_identical": exact, "load_and_swap": timings,
        "slot_loads": counters.num_slot_loads, "slot_evictions": counters.num_slot_evictions,
        "disk_loads": counters.num_disk_loads, "host_evictions": counters.num_host_evictions}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


if __name__ == "__main__":
    main()
