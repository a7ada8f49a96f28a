"""`optimum-cli neuron serve` / `python -m optimum_neuronx.serve`: resolve the model, start the engine process, serve
the app with uvicorn (or Ray Serve replicas: ray_app.py) until SIGTERM, which drains the requests in flight."""

from __future__ import annotations

import logging
import signal
from typing import Optional

from .options import build_parser, engine_options

logger = logging.getLogger(__name__)


def run_serve(args) -> int:
    from .app import EngineClient, build_app

    model, options = engine_options(args)
    served_name = args.served_model_name or args.model
    if args.replicas:
        from .ray_app import serve_on_ray

        return serve_on_ray(model, options, served_name, args)
    import uvicorn

    client = EngineClient(model, options, max_waiting=args.max_waiting, prefill_budget=args.prefill_budget)
    info = client.start()
    try:
        app = build_app(client, served_name, info)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                timeout_graceful_shutdown=args.graceful_shutdown_s)
        # uvicorn handles SIGTERM / SIGINT while it serves (stop accepting, finish the requests in flight), then
        # raises the signal again under the handler it found: this one, so that a drained server exits 0.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
        uvicorn.Server(config).run()
    finally:
        client.process.stop()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_serve(args)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
