"""The platform around many replicas, as pure policies with the runtime kept apart
(DESIGN.md §6): the degradation ladder (``ladder.py``) and the per-replica circuit breaker
(``breaker.py``). The routing policies live in ``kvserve/router/``."""
