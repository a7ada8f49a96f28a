"""Serving: the engine in its own process (worker.py), the OpenAI-compatible app (app.py), the launcher (launch.py)
and Ray Serve replicas (ray_app.py). Needs the [serve] extra (and [ray] for replicas)."""
