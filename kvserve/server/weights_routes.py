"""Admin routes that change the engine's weights without a restart (issue 19's warm tier):

- ``POST /admin/load_weights {"model": PATH}``: a same-shaped checkpoint replaces the weights;
  the engine's weight epoch is bumped, so no prefix-cache block from before is served again;
- ``POST /admin/sleep``: the KV cache is freed (GPU weights go to host memory); requests wait
  for ``wake`` or get 409 ``engine_busy``;
- ``POST /admin/wake``: weights back, a zeroed KV cache of the same plan.

The engine runs each once the requests already in flight have finished on the current weights,
holding newer ones until it is done (``ipc/weight_commands.py``): the HTTP call returns then.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request

from kvserve.errors import InvalidRequestError
from kvserve.server.errors import ServiceUnavailableError

logger = logging.getLogger("kvserve.server")


def add_weight_routes(app: FastAPI, ctx, engine_of, read_json) -> None:
    """Register the three routes; ``engine_of(ctx)`` gives the running engine client (503 if
    none), ``read_json(request, ctx)`` the checked JSON body."""

    async def run(action: str, path: str | None = None) -> dict:
        if ctx.disaggregated:
            raise ServiceUnavailableError("weights cannot be swapped on a disaggregated pair yet: restart it",
                                          code="not_supported")
        result = await engine_of(ctx).weights_command(action, path)
        logger.info("weights %s%s: %s", action, f" {path}" if path else "", result)
        return result

    @app.post("/admin/load_weights")
    async def load_weights(request: Request):
        """Admin: swap in the same-shaped checkpoint ``model`` (a path) between steps."""
        body = await read_json(request, ctx)
        path = body.get("model")
        if not isinstance(path, str) or not path.strip():
            raise InvalidRequestError('the body must be {"model": "<checkpoint path>"}', param="model")
        return {"loaded": True, **await run("load", path)}

    @app.post("/admin/sleep")
    async def sleep():
        """Admin: free the KV cache (and move GPU weights to host memory) until /admin/wake."""
        return {"asleep": True, **await run("sleep")}

    @app.post("/admin/wake")
    async def wake():
        """Admin: bring the weights back and allocate the KV cache again."""
        return {"asleep": False, **await run("wake")}
