"""The `tinypaged` command: serve | generate | weights (fetch | random)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from tinypaged.config import ConfigError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """vLLM's engine arguments, with its names and meanings."""
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model directory (default: the default model, fetched if missing)",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--swap-space", type=float, default=4.0, help="CPU swap space per GPU, in GiB")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None)
    p.add_argument("--enforce-eager", action="store_true", help="run every step eagerly (no CUDA graphs)")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap each step's host work with the device's (default: on for a GPU)",
    )


def _engine_kwargs(args: argparse.Namespace) -> dict:
    keys = (
        "dtype device seed block_size gpu_memory_utilization num_gpu_blocks_override swap_space "
        "enable_prefix_caching max_num_seqs max_num_batched_tokens max_model_len preemption_mode enforce_eager "
        "async_scheduling"
    ).split()
    return {k: getattr(args, k) for k in keys}


def _engine_config(args: argparse.Namespace):  # noqa: ANN202 - keeps `tinypaged --help` free of imports
    """The EngineConfig the engine arguments describe (the same fields `LLM(...)` takes)."""
    from tinypaged.config import EngineConfig
    from tinypaged.weights.fetch import resolve_model

    return EngineConfig.from_engine_args(resolve_model(args.model), **_engine_kwargs(args))


def _serve(args: argparse.Namespace) -> int:
    from tinypaged.engine.async_engine import AsyncEngine
    from tinypaged.server.app import ServerConfig, serve

    engine_config = _engine_config(args)
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
        max_queue_len=args.max_queue_len,
        max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
    )
    return serve(lambda: AsyncEngine(engine_config), server_config)


def _generate(args: argparse.Namespace) -> int:
    from tinypaged.llm import LLM
    from tinypaged.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.sampling_seed)
    prompt = args.prompt
    llm = LLM(model=args.model, **_engine_kwargs(args))
    if args.chat:
        prompt = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt}])
    out = llm.generate([prompt], params)[0]
    if out.error:
        raise ValueError(out.error)
    print(out.outputs[0].text)
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="tinypaged", description="A small, fast LLM serving engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000, help="0: any free port (the URL is printed)")
    srv.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on the API routes")
    srv.add_argument("--served-model-name", default=None, help="its name in the API (default: dir name)")
    srv.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="answer 503 + Retry-After while this many requests wait (default: unbounded)",
    )
    srv.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413")
    srv.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script: bad input ends with one `error:` line and exit status 2."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    try:
        return args.func(args)
    except (ConfigError, ValueError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if type(e).__name__ == "WeightsError":
            print(f"error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
