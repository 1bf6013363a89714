"""Many replicas (docs/cluster.md). Pure platform policies: the degradation ladder
(``ladder.py``), its use at the ingress (``degrade.py``) and a circuit breaker
(``breaker.py``). The Ray Serve cluster mode (the ``cluster`` extra): loopback-only Ray
(``ray_runtime.py``), ``EngineReplica`` (``replica.py`` + ``asgi_bridge.py``), ``Ingress``,
``KVServeRequestRouter`` (``ray_router.py``, calling ``kvserve.router``), ``app.py`` and
``cli.py``. Only ``app.py``, ``ray_runtime.py`` and ``ray_router.py`` import Ray."""
