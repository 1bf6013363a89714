"""KV memory: the block pool, the radix prefix cache, cache events, the KVCacheManager
that owns matching, eviction, allocation, fork and free, and the sizing arithmetic.

Everything here but ``tensors`` is pure Python (no torch)."""
