"""Prefill/decode disaggregation (docs/disaggregation.md): a prefill engine computes a
long prompt's KV, the full blocks move to the decode engine's prefix cache through a
``KVTransfer``, and the decode engine continues as on a prefix hit."""
