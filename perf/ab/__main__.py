"""`python -m perf.ab ...`: the A/B harness (perf.ab.harness)."""
import sys

from perf.ab.harness import main

sys.exit(main())
