"""How the engine's cost grows with context: prefill and decode speed, and peak memory, for one
request of a long prompt.

    python benchmarks/long_context.py                          # tiny 4K-128K, small 4K-32K
    python benchmarks/long_context.py --sizes tiny --contexts 4096 16384

Each point runs in a fresh process (its peak RSS is its own) on a generated checkpoint whose
context is 128K tokens (`pagedbatch make-model --max-position-embeddings 131072`: YaRN from the
size's 2,048 or 4,096 positions), with a KV cache of exactly the point's context (prompt plus
output) and the default token budget (prefill in chunks of 2,048). One request: a prompt of
`context - output` tokens, `--output` tokens out (greedy, ignore_eos).

Figures per point: `prefill_tok_s` (prompt tokens over the time to the first token),
`decode_tok_s` (the other output tokens over the time after it), `peak_rss_mib`, and the
weights' and KV cache's MiB, which with 1 GiB bound what the RSS may be. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pagedbatch.make_model import long_context, make_model

CONTEXT = 131_072
DEFAULT_CONTEXTS = {"tiny": [4096, 16384, 65536, 131072], "small": [4096, 16384, 32768]}

# Run in a child: the model, the context, the output length.
_POINT = r"""
import json, sys, time
from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.engine.worker.host_memory import peak_rss_mib
model, context, output = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = LLM(model, num_kv_blocks=-(-context // 16), max_model_len=context)
ids = [(i * 7919) % 16_000 + 10 for i in range(context - output)]
started = time.perf_counter()
(out,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
wall = time.perf_counter() - started
ttft = out.metrics.ttft
print(json.dumps({
    "prefill_tok_s": round(len(ids) / ttft, 1),
    "decode_tok_s": round((output - 1) / (out.metrics.e2e - ttft), 1),
    "wall_s": round(wall, 2),
    "peak_rss_mib": int(peak_rss_mib()),
    "kv_mib": sum(k.nbytes + v.nbytes for k, v in llm.engine.runner.kv_caches) // 2**20,
}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--contexts", nargs="+", type=int, help="default: per size, see above")
    parser.add_argument("--output", type=int, default=32)
    args = parser.parse_args()
    figures: dict = {"output": args.output, "points": []}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model = make_model(
                Path(tmp) / size, size=size, config_overrides=long_context(size, CONTEXT)
            )
            weights_mib = (model / "model.safetensors").stat().st_size // 2**20
            for context in args.contexts or DEFAULT_CONTEXTS[size]:
                done = subprocess.run(
                    [sys.executable, "-c", _POINT, str(model), str(context), str(args.output)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                point = json.loads(done.stdout.strip().splitlines()[-1])
                figures["points"].append(
                    {"size": size, "context": context, "weights_mib": weights_mib, **point}
                )
                print(json.dumps(figures["points"][-1]), file=sys.stderr)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
