"""`python -m perf.soak ...`: the soak (perf.soak.run)."""
import sys

from perf.soak.run import main

sys.exit(main())
