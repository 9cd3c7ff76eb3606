"""The tensor-parallel tests share tp_compare.py (what two engines' outputs must agree on) and
tests/models/fp8_checkpoints.py and int4_checkpoints.py (checkpoints written to the published
layouts)."""

import os
import sys

here = os.path.dirname(__file__)
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(os.path.dirname(here), "models"))
