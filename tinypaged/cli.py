"""The `tinypaged` command: serve | generate | warmup | quantize | weights (fetch | random) | worker."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import typing
from pathlib import Path

from tinypaged.config import SERVE_DEFAULTS, STALL_TIMEOUT_S, ConfigError, EngineConfig
from tinypaged.errors import EngineError


def _add_engine_args(p: argparse.ArgumentParser, defaults: dict[str, typing.Any] | None = None) -> None:
    """One flag per engine argument (EngineConfig's fields: vLLM's names, defaults and meanings); `defaults`
    overrides some of the defaults for this subcommand."""
    hints = typing.get_type_hints(EngineConfig)
    for f in EngineConfig.engine_args():
        default = (defaults or {}).get(f.name, f.default)
        flag = "--" + f.name.replace("_", "-")
        kinds = set(typing.get_args(hints[f.name])) - {type(None)} or {hints[f.name]}
        help_text = f.metadata["help"]
        if kinds == {bool}:
            # A bool that is off by default gets --x; one on by default or decided for you (None), --x / --no-x.
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            p.add_argument(flag, action=action, default=default, help=help_text)
            continue
        kind = Path if Path in kinds else next(iter(kinds - {str}), str)
        if typing.get_origin(kind) is dict:
            kind = str  # JSON text, as vLLM's flags take it: EngineConfig parses and checks it
        # Choices are listed, not enforced by argparse: EngineConfig checks every value, with one message.
        notes = [f"one of: {', '.join(map(str, f.metadata['choices']))}"] if "choices" in f.metadata else []
        notes += [f"default: {default}"] if default is not None else []
        if notes:
            help_text += f" ({'; '.join(notes)})"
        p.add_argument(flag, type=kind, default=default, help=help_text)


def _engine_args(args: argparse.Namespace) -> dict:
    """The engine arguments the flags give (the fields of EngineConfig, as `LLM(...)` takes them)."""
    return {f.name: getattr(args, f.name) for f in EngineConfig.engine_args()}


def _serve(args: argparse.Namespace) -> int:
    from tinypaged.engine.frontend.async_engine import AsyncEngine
    from tinypaged.engine.frontend.process_engine import ProcessEngine
    from tinypaged.quantization import canonical_quantization
    from tinypaged.server.app import ServerConfig, serve
    from tinypaged.weights.fetch import DEFAULT_MODEL_NAME, default_gguf_path

    kwargs = _engine_args(args)
    quant = kwargs["quantization"]
    quant = canonical_quantization(quant) if isinstance(quant, str) else quant  # as EngineConfig reads it
    default_gguf = kwargs["model"] is None and (
        quant == "gguf" or (quant is None and _on_cpu(kwargs["device"]))
    )
    if default_gguf:  # the default model as shipped, its Q4_1 GGUF kept quantized (docs/quantization.md)
        kwargs["model"] = default_gguf_path()
    engine_config = EngineConfig(**kwargs)
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name or (DEFAULT_MODEL_NAME if default_gguf else None),
        max_queue_len=args.max_queue_len,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        idle_timeout=args.idle_timeout,
    )
    if not args.engine_stall_timeout >= 0:
        raise ValueError(
            f"--engine-stall-timeout must be 0 (off) or positive, not {args.engine_stall_timeout}"
        )
    if args.replicas is not None or args.ray_address is not None:
        return _serve_replicas(args, engine_config, server_config)
    engine = ProcessEngine if args.engine_process else AsyncEngine
    return serve(lambda: engine(engine_config, stall_timeout=args.engine_stall_timeout), server_config)


def _on_cpu(device: str) -> bool:
    """Whether the engine runs on the CPU: asked to, or "auto" without a CUDA GPU."""
    if device != "auto":
        return device == "cpu"
    import torch

    return not torch.cuda.is_available()


def _serve_replicas(args: argparse.Namespace, engine_config: EngineConfig, server_config: typing.Any) -> int:
    """`serve --replicas N`: the same server in N replicas behind Ray Serve (tinypaged/replicas/)."""
    try:
        from tinypaged.replicas.launch import serve_replicas
    except ImportError as e:
        raise ValueError(f"--replicas needs Ray Serve: pip install -e '.[ray]' ({e})") from e
    limits = ("api_key", "served_model_name", "max_queue_len", "max_body_bytes", "shutdown_timeout")
    app_args = {
        "engine": _engine_args(args) | {"model": str(engine_config.model_config.path)},
        "server": {k: getattr(server_config, k) for k in limits},
        "replicas": args.replicas or 1,
        "max_replicas": args.max_replicas,
        "router": args.router,
        "engine_process": args.engine_process,
        "engine_stall_timeout": args.engine_stall_timeout,
    }
    app_args["engine"] = {k: str(v) if isinstance(v, Path) else v for k, v in app_args["engine"].items()}
    return serve_replicas(app_args, args.host, args.port, args.ray_address)


def _generate(args: argparse.Namespace) -> int:
    from tinypaged.llm import LLM
    from tinypaged.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    with LLM(**_engine_args(args)) as llm:
        prompt = args.prompt
        if args.chat:  # the template writes the special tokens (a BOS among them): none added again
            tok = llm.get_tokenizer()
            text = tok.apply_chat_template([{"role": "user", "content": prompt}])
            prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
        out = llm.generate([prompt], params)[0]
    if out.error:
        raise ValueError(out.error)
    print(out.outputs[0].text)
    return 0


def _warmup(args: argparse.Namespace) -> int:
    from tinypaged.llm import LLM

    with LLM(**_engine_args(args)) as llm:
        stats = llm.engine.runner.stats
        phases = llm.engine.startup
        graph, t = llm.engine.runner.cpu_graph, time.perf_counter()
        state = graph.wait() if graph is not None else ""  # the CPU's decode graph, built if it was not
    print("startup: " + ", ".join(f"{name} {s:.2f} s" for name, s in phases))
    if graph is not None:
        print(f"CPU decode graph: {state} after {time.perf_counter() - t:.1f} s ({graph.path})")
        return 0 if state == "loaded" else 1
    if not stats.compile_cache:
        print("nothing to compile: the engine runs on the CPU and no decode graph takes this model")
        return 0
    kernels = sum(1 for e in Path(os.environ["TRITON_CACHE_DIR"]).iterdir() if e.is_dir())
    print(f"compile cache: {stats.compile_cache} at the start, {kernels} kernels now")
    return 0


def _worker(args: argparse.Namespace) -> int:
    from tinypaged.engine.device.worker import main as worker_main

    argv = ["--rank", str(args.rank)] + (
        [] if args.local_rank is None else ["--local-rank", str(args.local_rank)]
    )
    return worker_main(argv)


def _weights(args: argparse.Namespace) -> int:
    from tinypaged.weights.fetch import fetch_default_model

    kwargs = {"force": args.force}
    if args.out is not None:
        kwargs["out_dir"] = args.out
    path = fetch_default_model(**kwargs)
    print(path)
    return 0


def _random_weights(args: argparse.Namespace) -> int:
    from tinypaged.weights.random_model import make_random_model

    print(make_random_model(args.config, args.out, seed=args.seed))
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from tinypaged.model.quant.writer import quantize_checkpoint
    from tinypaged.weights.fetch import resolve_model

    print(quantize_checkpoint(resolve_model(args.model), args.out))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="tinypaged", description="A small, fast LLM serving engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_engine_args(srv, SERVE_DEFAULTS)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000, help="0: any free port (the URL is printed)")
    srv.add_argument(
        "--api-key",
        default=os.environ.get("TINYPAGED_API_KEY") or None,
        help="require `Authorization: Bearer KEY` on the API routes (default: $TINYPAGED_API_KEY, which keeps the key "
        "out of the process list)",
    )
    srv.add_argument("--served-model-name", default=None, help="its name in the API (default: dir name)")
    srv.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="most sequences waiting (prompts x n or best_of): a request that would pass it gets 503 + Retry-After "
        "(default: unbounded)",
    )
    srv.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    srv.add_argument(
        "--idle-timeout",
        type=float,
        default=75.0,
        help="seconds a connection may take to send a request's headers (or idle between requests) before it is "
        "closed, and a request's body to arrive before 408",
    )
    srv.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in a process of its own, so that the HTTP work does not share the steps' "
        "interpreter lock (--no-engine-process: in the server's process)",
    )
    srv.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=STALL_TIMEOUT_S,
        help="seconds the engine may go without a step while it has work (or its core process without a "
        "heartbeat) before it is declared stalled: /health answers 503 naming it and its requests fail, until it "
        "steps again (0: never)",
    )
    srv.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="serve N replicas of the engine behind Ray Serve, routed by what each one's prefix cache holds "
        "(needs the `ray` extra; docs/replicas.md)",
    )
    srv.add_argument(
        "--max-replicas",
        type=int,
        default=None,
        help="with --replicas: autoscale between --replicas and this many on queue depth (Ray Serve autoscaling)",
    )
    srv.add_argument(
        "--router",
        default="kv",
        choices=("kv", "pow2", "prefix-affinity"),
        help="with --replicas: kv (longest cached prefix against load), pow2 (power of two choices), or "
        "prefix-affinity (Ray Serve LLM's PrefixCacheAffinityRouter)",
    )
    srv.add_argument(
        "--ray-address",
        default=None,
        help="with --replicas: join this Ray cluster (e.g. ray://head:10001 or auto) instead of starting Ray here",
    )
    srv.set_defaults(func=_serve)

    gen = sub.add_parser("generate", help="print the continuation of one prompt")
    _add_engine_args(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this request's sampling")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("prompt")
    gen.set_defaults(func=_generate)

    warm = sub.add_parser(
        "warmup",
        help="start the engine once, so that every kernel it can launch is compiled into the compile cache",
        description="Loads the model, captures the CUDA graphs and compiles every kernel that `serve` with the "
        "same flags can launch, into the compile cache under the model cache directory ($TINYPAGED_HOME/"
        "compile/triton, or $TRITON_CACHE_DIR), then exits: run it while building a VM image or a container, so "
        "that a server started there later loads its kernels instead of compiling them (docs/serving.md).",
    )
    _add_engine_args(warm, SERVE_DEFAULTS)
    warm.set_defaults(func=_warmup)

    quant = sub.add_parser(
        "quantize",
        help="write a bf16 or f32 model as a compressed-tensors FP8 checkpoint (FP8_DYNAMIC, as vLLM loads it)",
        description="E4M3 weights with one scale per output channel for the decoder's linear layers, activations "
        "quantized per token at run time; the embedding, norms and LM head kept as they are (docs/quantization.md).",
    )
    quant.add_argument(
        "--model", type=Path, default=None, help="the model directory (default: the default model)"
    )
    quant.add_argument("--out", type=Path, required=True, help="the new model directory to write")
    quant.set_defaults(func=_quantize)

    weights = sub.add_parser("weights", help="model weights tooling")
    wsub = weights.add_subparsers(dest="weights_command", required=True)
    fetch = wsub.add_parser("fetch", help="download and convert the default model (SmolLM2-135M-Instruct)")
    fetch.add_argument("--out", type=Path, default=None)
    fetch.add_argument(
        "--force", action="store_true", help="convert again even when the directory is complete"
    )
    fetch.set_defaults(func=_weights)
    from tinypaged.weights.random_model import PRESETS

    rand = wsub.add_parser("random", help="write a model directory of a real shape with random bf16 weights")
    rand.add_argument("--config", required=True, choices=sorted(PRESETS), help="the shape to copy")
    rand.add_argument("--out", type=Path, required=True, help="the model directory to write")
    rand.add_argument("--seed", type=int, default=0)
    rand.set_defaults(func=_random_weights)

    worker = sub.add_parser(
        "worker",
        help="a tensor-parallel worker on another node: joins the engine at MASTER_ADDR:MASTER_PORT",
        description="One worker process for one rank of a tensor-parallel engine whose rank 0 (the engine, "
        "`tinypaged serve --tensor-parallel-size N` with LOCAL_WORLD_SIZE set to its node's ranks) runs "
        "elsewhere; the engine's arguments come from rank 0.",
    )
    worker.add_argument("--rank", type=int, required=True, help="this worker's rank (1 .. N - 1)")
    worker.add_argument(
        "--local-rank",
        type=int,
        default=None,
        help="its GPU on this node (default: LOCAL_RANK, else the rank)",
    )
    worker.set_defaults(func=_worker)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script: bad input ends with one `error:` line and exit status 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    try:
        return args.func(args)
    # OSError: a path that cannot be read or written (a model directory, an output directory)
    except (ConfigError, ValueError, MemoryError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:  # e.g. a tensor-parallel worker that died
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from tinypaged.weights import WeightsError  # not at the top: it pulls numpy into `--help`

        if isinstance(e, WeightsError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
