"""``kvserve bench``: a load generator for any OpenAI-compatible server (see docs/server.md)."""
