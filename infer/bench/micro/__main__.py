import sys

from infer.bench.micro import main

sys.exit(main())
