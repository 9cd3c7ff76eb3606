"""Make the fake engine and workspace helpers importable from the pipeline tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
