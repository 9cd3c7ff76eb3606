"""The tensor-parallel tests share tp_compare.py (what two engines' outputs must agree on)."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
