"""Make the FP8 checkpoint writers importable from the model tests."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
