"""`python -m batchgen ...` runs the command line (for checkouts without an installed script)."""

from batchgen.cli import main

main()
