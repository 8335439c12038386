"""The `pagedbatch` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagedbatch.addresses import is_loopback

ARCHS = ("llama", "qwen2", "mistral")
SIZES = ("tiny", "small", "medium")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags for EngineArgs fields; names as vLLM spells them."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="model directory (Hugging Face layout)")
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="auto")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=128)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gib", type=float, default=None)
    g.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=True
    )
    g.add_argument("--scheduling-policy", default="priority", choices=["priority", "fcfs"])
    g.add_argument("--tensor-parallel-size", type=int, default=1)


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = (
        "served_model_name", "dtype", "device", "max_model_len", "max_num_seqs",
        "max_num_batched_tokens", "block_size", "num_kv_blocks", "kv_cache_memory_gib",
        "enable_prefix_caching", "scheduling_policy", "tensor_parallel_size",
    )  # fmt: skip
    return {name: getattr(args, name) for name in names}


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    """A flag for every service setting (`--database-url` for PAGEDBATCH_DATABASE_URL, ...);
    a flag given wins over the environment."""
    from pagedbatch.settings import Settings

    g = parser.add_argument_group("service settings (also PAGEDBATCH_* environment variables)")
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        # A yes-or-no setting's flag alone means yes (`--allow-unauthenticated`).
        switch = {"nargs": "?", "const": "true"} if field.annotation is bool else {}
        g.add_argument(
            flag,
            dest=f"setting_{name}",
            default=None,
            metavar=name.upper(),
            help=field.description,
            **switch,
        )


def settings_from_args(args: argparse.Namespace):
    from pagedbatch.settings import Settings

    given = {
        name.removeprefix("setting_"): value
        for name, value in vars(args).items()
        if name.startswith("setting_") and value is not None
    }
    return Settings(**given)


def service_settings(args: argparse.Namespace):
    """The settings of a long-running service command, with its logging set up by them."""
    from pagedbatch.logs import configure_logging

    settings = settings_from_args(args)
    configure_logging(settings.log_format)
    return settings


def check_exposure(settings) -> None:
    """Refuses to serve beyond loopback without API keys unless told it is on purpose: anyone
    who reached the port would have the engine and every file and batch."""
    if settings.api_keys or settings.allow_unauthenticated or is_loopback(settings.host):
        return
    raise ValueError(
        f"refusing to serve on {settings.host}, beyond loopback, without API keys: set "
        "PAGEDBATCH_API_KEYS (--api-keys), or listen on 127.0.0.1, or if anyone who can reach "
        "the port may use it, set PAGEDBATCH_ALLOW_UNAUTHENTICATED=true (--allow-unauthenticated)"
    )


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedbatch import service

    settings = service_settings(args)
    check_exposure(settings)
    # No log_config: uvicorn's loggers then propagate to the handler configured above.
    if settings.distributed:
        app = service.api_only(settings)
        uvicorn.run(app, host=settings.host, port=settings.port, log_config=None)
        return 0
    embedded = service.embedded(settings)
    try:
        uvicorn.run(embedded.app, host=settings.host, port=settings.port, log_config=None)
    finally:
        embedded.shutdown()
    return 0


def _worker(args: argparse.Namespace) -> int:
    from pagedbatch import service

    settings = service_settings(args)
    if not settings.distributed:
        raise ValueError("a worker needs a broker: set PAGEDBATCH_BROKER_URL or --broker-url")
    service.run_worker(settings, beat=args.beat)
    return 0


def _db_upgrade(args: argparse.Namespace) -> int:
    from pagedbatch.store.migrate import upgrade

    settings = settings_from_args(args)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    upgrade(settings.resolved_database_url)
    print(f"database at {settings.resolved_database_url} is up to date")
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from pagedbatch.make_model import make_model

    path = make_model(args.dir, arch=args.arch, size=args.size, seed=args.seed)
    print(path)
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    from pagedbatch.run_batch import run_batch

    run_batch(args.input, args.output, args.model, **engine_kwargs(args))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedbatch")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="write a deterministic random checkpoint for tests")
    p.add_argument("--arch", choices=ARCHS, default="llama")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("dir")
    p.set_defaults(func=_make_model)

    p = sub.add_parser("run-batch", help="run an OpenAI batch JSONL file offline")
    p.add_argument("-i", "--input", required=True, help="input JSONL (OpenAI batch lines)")
    p.add_argument("-o", "--output", required=True, help="output JSONL")
    add_engine_args(p)
    p.set_defaults(func=_run_batch)

    p = sub.add_parser("serve", help="start the service (embedded unless a broker is set)")
    add_settings_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("worker", help="start a GPU worker of the distributed deployment")
    p.add_argument(
        "--beat", action="store_true", help="deprecated and ignored: every worker runs upkeep"
    )
    add_settings_args(p)
    p.set_defaults(func=_worker)

    p = sub.add_parser("db", help="the job store's database")
    db = p.add_subparsers(dest="db_command", required=True)
    p = db.add_parser("upgrade", help="migrate the database to the current schema")
    add_settings_args(p)
    p.set_defaults(func=_db_upgrade)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagedbatch: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
