"""``GET /cluster/status`` on the ingress: Ray Serve's own view of this application's
deployments (``serve.status()``, read in the ingress's process, which is inside the cluster):
per deployment its status and its replicas by state, so a client (and the scale-from-zero
test) sees the replica count Ray Serve holds without joining Ray. The ingress answers it itself:
it never reaches a replica, so asking does not wake a model scaled to zero. A deployment under
kvserve's autoscaling policy also shows the policy's last decision (``autoscale``: its tier now
and planned, the replicas asked for and why; ``policy_board.py``)."""
from __future__ import annotations

from starlette.responses import JSONResponse

PATH = "/cluster/status"


def application_status(app_name: str) -> dict:
    """``{"application": name, "status": ..., "deployments": {name: {"status", "replicas":
    {state: count}, "running"[, "autoscale"]}}}`` from ``serve.status()`` (a blocking call to the
    controller) and the policy board."""
    from ray import serve

    from kvserve.cluster import policy_board
    app = serve.status().applications[app_name]
    deployments = {}
    for name, dep in app.deployments.items():
        replicas = {str(getattr(state, "value", state)): int(count) for state, count in dep.replica_states.items()}
        deployments[name] = {"status": str(getattr(dep.status, "value", dep.status)), "replicas": replicas,
                             "running": replicas.get("RUNNING", 0)}
        decision = policy_board.read(app_name, name)
        if decision is not None:
            deployments[name]["autoscale"] = decision
    return {"application": app_name, "status": str(getattr(app.status, "value", app.status)),
            "deployments": deployments}


def unauthorized() -> JSONResponse:
    """401 in the API's error shape (keys are configured and the request had none that matches)."""
    error = {"message": "a valid API key is required", "type": "authentication_error", "param": None,
             "code": "invalid_api_key"}
    return JSONResponse({"error": error}, status_code=401)
