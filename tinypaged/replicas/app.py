"""The Ray Serve application: an ingress (ingress.py) in front of N engine replicas (replica.py), routed by a
chosen request router, and a board for their metrics. `build_app` is both what `tinypaged serve --replicas N`
runs and the import path a Ray Serve config file names (deploy/ray-serve.yaml, `serve run` / `serve deploy`).

Routers (`router`): `kv` (router.py: the longest prefix each replica's cache holds, against load), `pow2` (Ray
Serve's default, power of two choices), `prefix-affinity` (Ray Serve LLM's PrefixCacheAffinityRouter, with the
settings Ray's documentation gives it).

Resources: a replica on a GPU takes `tensor_parallel_size` GPUs, in one bundle of a STRICT_PACK placement
group, so the engine's tensor-parallel workers (its own processes, torch.distributed) see them all on one node.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from tinypaged.config import STALL_TIMEOUT_S, EngineConfig
from tinypaged.replicas.ingress import Ingress
from tinypaged.replicas.replica import EngineReplica, MetricsBoard

ROUTERS = {
    "kv": "tinypaged.replicas.router:KVAwareRouter",
    "pow2": "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    # Ray Serve LLM's router, from the module that defines it: `ray.serve.llm.request_router` re-exports it (a
    # subclass adding a docstring), but importing `ray.serve.llm` needs vLLM or SGLang installed.
    "prefix-affinity": (
        "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:PrefixCacheAffinityRouter"
    ),
}
# PrefixCacheAffinityRouter as the example of Ray Serve LLM's "Prefix-aware routing" guide configures it.
PREFIX_AFFINITY_KWARGS = {
    "imbalanced_threshold": 5,
    "match_rate_threshold": 0.15,
    "do_eviction": True,
    "eviction_threshold_chars": 500_000,
    "eviction_target_chars": 400_000,
    "eviction_interval_secs": 30,
}
ROUTING_STATS_PERIOD_S = 0.5  # how often each replica publishes its cached blocks to the routers
MAX_ONGOING = 128  # requests a replica takes at once (its engine batches them; more wait in the router)
# How often a stopping replica looks for requests still in flight (Serve's default, 2 s, made each of the three
# deployments, deleted one after another, wait 2 s when idle: an idle `serve --replicas` took 7-13 s to exit).
DRAIN_POLL_S = 0.2


def _router_config(router: str, kwargs: dict[str, Any] | None = None) -> RequestRouterConfig:
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {router!r}")
    module, name = ROUTERS[router].split(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    return RequestRouterConfig(
        request_router_class=cls,
        request_router_kwargs=(PREFIX_AFFINITY_KWARGS if router == "prefix-affinity" else {})
        | (kwargs or {}),
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        request_routing_stats_timeout_s=5.0,
    )


def _replica_resources(config: EngineConfig, gpus: bool) -> dict[str, Any]:
    """The replica's actor options: on GPUs, its tensor-parallel GPUs in one STRICT_PACK bundle."""
    if not gpus:
        return {"ray_actor_options": {"num_cpus": 1}}
    tp = config.tensor_parallel_size
    return {
        "ray_actor_options": {"num_cpus": 1, "num_gpus": tp},
        "placement_group_bundles": [{"CPU": 1, "GPU": tp}],
        "placement_group_strategy": "STRICT_PACK",
    }


def _use_gpus(config: EngineConfig) -> bool:
    import ray

    if config.device == "cpu":
        return False
    return ray.cluster_resources().get("GPU", 0) >= config.tensor_parallel_size


def build_app(args: dict[str, Any]) -> serve.Application:
    """The application from its arguments (a Serve config's `args`): `engine` (EngineConfig's fields), `server`
    (ServerConfig's limits: api_key, served_model_name, max_queue_len, max_body_bytes, shutdown_timeout),
    `replicas` (a count; with `max_replicas` above it, the least of an autoscaled range), `target_ongoing_requests`
    (autoscaling's target queue depth per replica; `autoscaling`: other fields of Ray Serve's AutoscalingConfig,
    such as its delays), `router` (and `router_kwargs`, its initialize_state's
    arguments), `engine_process`, `engine_stall_timeout`."""
    engine_kwargs = dict(args.get("engine") or {})
    server_kwargs = dict(args.get("server") or {})
    config = EngineConfig(**engine_kwargs)
    engine_kwargs["model"] = str(config.model_config.path)  # resolved once, here
    replicas = int(args.get("replicas", 1))
    most = int(args.get("max_replicas") or replicas)
    if replicas < 1 or most < replicas:
        raise ValueError(f"need 1 <= replicas <= max_replicas, got {replicas} and {most}")
    scale: dict[str, Any] = {"num_replicas": replicas}
    if most > replicas:
        autoscaling = {
            "min_replicas": replicas,
            "max_replicas": most,
            "target_ongoing_requests": float(args.get("target_ongoing_requests", 8)),
            "upscale_delay_s": 5.0,
            "downscale_delay_s": 60.0,
        }
        scale = {
            "autoscaling_config": AutoscalingConfig(**(autoscaling | dict(args.get("autoscaling") or {})))
        }
    shutdown = float(server_kwargs.get("shutdown_timeout", 30.0))
    replica = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        max_ongoing_requests=MAX_ONGOING,
        request_router_config=_router_config(args.get("router", "kv"), args.get("router_kwargs")),
        graceful_shutdown_timeout_s=shutdown,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
        health_check_period_s=5.0,
        **scale,
        **_replica_resources(config, _use_gpus(config)),
    )
    board = serve.deployment(
        MetricsBoard,
        name="MetricsBoard",
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=1.0,
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
    )
    ingress = serve.deployment(
        serve.ingress()(Ingress),
        name="Ingress",
        max_ongoing_requests=4096,
        ray_actor_options={"num_cpus": 0},
        graceful_shutdown_timeout_s=shutdown,  # its relays of in-flight requests drain as the replicas do
        graceful_shutdown_wait_loop_s=DRAIN_POLL_S,
    )
    board_app = board.bind()
    engine_app = replica.bind(
        engine_kwargs,
        server_kwargs,
        board_app,
        bool(args.get("engine_process", True)),
        float(args.get("engine_stall_timeout", STALL_TIMEOUT_S)),
    )
    limits = {k: server_kwargs[k] for k in ("api_key", "max_body_bytes") if k in server_kwargs}
    return ingress.bind(engine_app, board_app, engine_kwargs, **limits)
