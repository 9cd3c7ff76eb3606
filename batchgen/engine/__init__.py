"""The engine: pure-Python bookkeeping (sequences, KV blocks, scheduling) and the model runner."""
