"""Make the checkpoint writers beside the model tests (4-bit, FP8) importable from them."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
