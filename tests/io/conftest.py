"""Make the fake engine and workspace helpers importable from the pipeline tests."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "pipeline"))
