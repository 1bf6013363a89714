"""One measured cold start: ``python -m kvserve.coldstart.child SPEC_JSON`` (see ``measure.py``).

Timestamps (``time.time()``, comparable with the parent's) are taken at the interpreter's
start, after the runtime imports, after the engine is built, and around two requests; the
engine's own ``start_timings`` split the build. With ``wait_for_go`` the process imports,
prints ``ready`` and waits for a line on stdin before building: a pre-started process.
Prints one JSON object on stdout's last line.
"""
import time

STARTED = time.time()

import json  # noqa: E402
import sys  # noqa: E402


def main() -> int:
    spec = json.loads(sys.argv[1])
    import torch  # noqa: F401  (the runtime layer: torch and kvserve's engine imports)

    from kvserve.frontend.llm import LLM
    from kvserve.sampling.params import SamplingParams
    imported = time.time()
    go = imported
    if spec.get("wait_for_go"):
        print("ready", flush=True)
        sys.stdin.readline()
        go = time.time()
    llm = LLM(spec.get("model"), dtype="float32", kv_cache_bytes=spec["kv_cache_bytes"],
              warmup=spec.get("warmup", False), weight_cache_dir=spec.get("weight_cache_dir"),
              num_threads=spec.get("threads"))
    built = time.time()
    params = SamplingParams(temperature=0, max_tokens=1)
    first = time.perf_counter()
    llm.generate(["Write a haiku about paged memory."], params)
    first_s = time.perf_counter() - first
    second = time.perf_counter()
    llm.generate(["What is the capital of France?"], params)
    second_s = time.perf_counter() - second
    print(json.dumps({"started": STARTED, "imported": imported, "go": go, "built": built,
                      "first_request_s": first_s, "steady_request_s": second_s,
                      "start_timings": llm.engine.start_timings}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
