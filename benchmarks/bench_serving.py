r"""The five serving workloads' benchmark against a running OpenAI-compatible server (a thin wrapper).

    python benchmarks/bench_serving.py --server http://127.0.0.1:8000 --model embedded \
        --workload all --seed 42

Same flags as `infer bench serve`; see `infer/bench/serving.py`.
"""

import sys

from infer.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
