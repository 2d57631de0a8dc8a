"""`python -m tuner SUBCOMMAND ...`: see tuner.cli."""
from tuner.cli import run

run()
