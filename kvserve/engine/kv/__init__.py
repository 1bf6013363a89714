"""KV memory: the block pool, the radix prefix cache, cache events, the KVCacheManager
that owns matching, eviction, allocation, fork and free, and the sizing arithmetic.

Everything here but ``tensors`` and ``quantized`` (the 8-bit KV format) is pure Python (no torch)."""
