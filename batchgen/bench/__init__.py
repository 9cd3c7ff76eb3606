"""`batchgen bench`: standard workloads, measured ceilings, roofline and the transformers peer."""
