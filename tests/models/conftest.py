"""Make the quantized-checkpoint writers beside the model tests importable from them."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
