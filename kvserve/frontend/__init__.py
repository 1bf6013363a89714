"""The front end shared by offline use and the HTTP server: prompts in, text out.

``LLM`` (offline API), ``OutputProcessor`` (engine updates -> detokenised text, stop
strings, RequestOutputs), the output types and the ``kvserve generate`` CLI. It talks to
the engine only through ``EngineRequest`` and ``SeqUpdate``.
"""
