"""`python -m batchgen ...` runs the command line (for checkouts without an installed script)."""

from batchgen.cli import main

if __name__ == "__main__":  # not when a worker process (multiprocessing spawn) imports it
    main()
