"""The OpenAI-compatible HTTP server (``kvserve serve``): an HTTP process (FastAPI +
uvicorn: tokenise, chat templates, detokenise, stream) and an engine-core process,
talking through one msgpack codec. See docs/server.md."""
