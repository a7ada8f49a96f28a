"""The same app on Ray Serve: N replicas behind one endpoint, each with its own engine process and NeuronCores (Ray's
`neuron_cores` resource) or CPU cores; Ray's backpressure answers 429 with Retry-After past each replica's queue.

`optimum-cli neuron serve --model ... --replicas N` runs it; `serve run optimum_neuronx.server.ray_app:app model=...`
deploys it from a Serve config (see docs/serving.md).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

logger = logging.getLogger(__name__)
DEPLOYMENT_NAME = "optimum-neuronx"


def replica_app_builder(model: str, options: dict, served_model_name: str, max_waiting: Optional[int],
                        prefill_budget: Optional[int]):
    """A function Ray Serve calls in each replica: start that replica's engine, then build its app."""

    def build():
        from .app import EngineClient, build_app

        client = EngineClient(model, options, max_waiting=max_waiting, prefill_budget=prefill_budget)
        info = client.start()
        return build_app(client, served_model_name, info)

    return build


def deployment(model: str, options: dict, served_model_name: str, replicas: int, batch_size: int,
               max_waiting: Optional[int] = None, prefill_budget: Optional[int] = None, neuron_cores: int = 0,
               cpus_per_replica: float = 1.0):
    """The Ray Serve deployment: `replicas` replicas of the app, each admitting up to its slots plus its waiting
    queue; Ray queues up to `batch_size` more per replica, then answers 429. `.bind()` makes it an application."""
    from ray import serve
    from ray.serve.config import BackpressureConfig

    from .app import RETRY_AFTER_S

    waiting = 4 * batch_size if max_waiting is None else max_waiting
    resources = {"num_cpus": cpus_per_replica}
    if neuron_cores:
        resources["resources"] = {"neuron_cores": neuron_cores}
    ingress = serve.ingress(replica_app_builder(model, options, served_model_name, waiting, prefill_budget))
    return serve.deployment(
        ingress(), name=DEPLOYMENT_NAME, num_replicas=replicas, ray_actor_options=resources,
        max_ongoing_requests=batch_size + waiting, max_queued_requests=batch_size,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        graceful_shutdown_timeout_s=300.0,
    )


def app(args: dict):
    """`serve run optimum_neuronx.server.ray_app:app model=... replicas=2 batch_size=4 ...` (an application builder:
    Ray Serve passes the `key=value` arguments)."""
    from .options import engine_options, parse_serve_args

    parsed = parse_serve_args([f"--{key}={value}" for key, value in args.items()])
    model, options = engine_options(parsed)
    return deployment(model, options, parsed.served_model_name or parsed.model, max(parsed.replicas, 1),
                      _batch_size(parsed, options), parsed.max_waiting, parsed.prefill_budget,
                      _neuron_cores(parsed, options)).bind()


def _batch_size(args, options: dict) -> int:
    if "batch_size" in options:
        return options["batch_size"]
    from ..configuration import NeuronConfig

    return NeuronConfig.from_pretrained(args.model).batch_size


def _neuron_cores(args, options: dict) -> int:
    """NeuronCores a replica reserves on Neuron hardware: its tensor-parallel degree; none elsewhere."""
    if not _on_neuron_hardware():
        return 0
    if options:
        return args.tensor_parallel_size or 1
    from ..configuration import NeuronConfig

    return NeuronConfig.from_pretrained(args.model).tp_degree


def _on_neuron_hardware() -> bool:
    import glob

    return bool(glob.glob("/dev/neuron*"))


def serve_on_ray(model: str, options: dict, served_model_name: str, args) -> int:
    """Start Ray (locally, or join RAY_ADDRESS), deploy the replicas on args.host:args.port, block until SIGTERM /
    SIGINT, then shut Serve down (replicas finish their requests first)."""
    import ray
    from ray import serve

    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(deployment(model, options, served_model_name, args.replicas, _batch_size(args, options),
                         args.max_waiting, args.prefill_budget, _neuron_cores(args, options)).bind(),
              name=DEPLOYMENT_NAME, route_prefix="/")
    logger.info("serving %s on http://%s:%d with %d replicas", served_model_name, args.host, args.port,
                args.replicas)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0
