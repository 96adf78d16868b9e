r"""The race: `infer serve` against a peer (vLLM) on the same model and load, alternated (a thin wrapper).

    python benchmarks/race.py /work/models/llama-50m --peer-cmd "vllm serve /work/models/llama-50m \
        --dtype bfloat16 --max-model-len 2048 --port 8010" --peer-env VLLM_CPU_KVCACHE_SPACE=4

Same flags as `infer bench race`; see `infer/bench/race.py`.
"""

import sys

from infer.bench.race import main

if __name__ == "__main__":
    sys.exit(main())
