"""Tensor parallel: process groups (group.py), worker processes (workers.py), how a model splits
across ranks (partition.py), the parallel layers (layers.py) and the one-shot all-reduce
(one_shot.py). See README.md here for how the pieces meet."""
