"""The pipeline: runs a job from input rows to committed output shards."""
