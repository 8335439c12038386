"""The `pagedbatch` command."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args, get_origin, get_type_hints

from pagedbatch.addresses import is_loopback

logger = logging.getLogger(__name__)

NONE = type(None)
ARCHS = (
    "llama",
    "qwen2",
    "mistral",
    "gemma3",
    "qwen3",
    "phi3",
    "gemma2",
    "mixtral",
    "qwen3_moe",
    "llava",
    "qwen2_vl",
    "qwen2_audio",
    "bert",
)
SIZES = ("tiny", "small", "medium")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """A flag for every EngineArgs field, typed and checked as it says, for a command that
    builds an engine itself (`run-batch`); a flag not given leaves EngineArgs's default."""
    from pagedbatch.engine.config import EngineArgs

    g = parser.add_argument_group("engine")
    hints = get_type_hints(EngineArgs)
    for arg in dataclasses.fields(EngineArgs):
        # `int | None` is parsed as int: None is what a flag not given leaves.
        value_type = next(
            t for t in get_args(hints[arg.name]) or [hints[arg.name]] if t is not NONE
        )
        required = arg.default is dataclasses.MISSING
        _add_flag(
            g,
            arg.name,
            dest=arg.name,
            doc=arg.metadata["doc"],
            default=None if required else arg.default,
            parse=_yes_or_no if value_type is bool else value_type,
            choices=arg.metadata["choices"],
            switch=value_type is bool,
            required=required,
        )


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs fields given by `add_engine_args`'s flags, but `model`."""
    from pagedbatch.engine.config import EngineArgs

    given = {arg.name: getattr(args, arg.name) for arg in dataclasses.fields(EngineArgs)}
    return {name: value for name, value in given.items() if name != "model" and value is not None}


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    """A flag for every service setting (`--database-url` for PAGEDBATCH_DATABASE_URL, ...),
    the engine's included (`--max-num-seqs` for PAGEDBATCH_MAX_NUM_SEQS); a flag given wins over
    the environment. Values stay text here: Settings parses and checks them as the
    environment's."""
    from pagedbatch.settings import ENGINE_SETTINGS, ENV_PREFIX, Settings

    engine = parser.add_argument_group(f"engine settings (also {ENV_PREFIX}* variables)")
    service = parser.add_argument_group(f"service settings (also {ENV_PREFIX}* variables)")
    for name, field in Settings.model_fields.items():
        _add_flag(
            engine if name in ENGINE_SETTINGS else service,
            name,
            dest=f"setting_{name}",
            doc=field.description,
            default=field.get_default(call_default_factory=True),
            parse=str,
            choices=_literal_choices(field.annotation),
            switch=field.annotation is bool,
        )


def _add_flag(
    group: argparse._ArgumentGroup,
    name: str,
    *,
    dest: str,
    doc: str | None,
    default: Any,
    parse: Callable[[str], Any],
    choices: Sequence[Any] | None = None,
    switch: bool = False,
    required: bool = False,
) -> None:
    """`--the-name` for the setting `the_name`, stored in `dest` when given (else None). A
    yes-or-no one (`switch`) alone means yes (`--allow-unauthenticated`) and has a `--no-` flag
    too (`--no-prefix-caching` for `enable_prefix_caching`)."""
    flag = "--" + name.replace("_", "-")
    shown = None if default in (None, [], "") else f"(default: {_shown(default)})"
    help_text = " ".join(filter(None, [doc, shown])).replace("%", "%%")  # argparse formats it
    if not switch:
        group.add_argument(
            flag,
            dest=dest,
            type=parse,
            choices=choices,
            required=required,
            metavar=None if choices else name.upper(),
            help=help_text,
        )
        return
    yes, no = parse("true"), parse("false")
    group.add_argument(
        flag, dest=dest, nargs="?", const=yes, type=parse, metavar="BOOL", help=help_text
    )
    negative = "--no-" + name.removeprefix("enable_").replace("_", "-")
    group.add_argument(negative, dest=dest, action="store_const", const=no, help=f"{flag} false")


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return str(default).lower()
    return str(default)


def _yes_or_no(text: str) -> bool:
    """A yes-or-no flag's value, spelled as the environment's may be."""
    lowered = text.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values a Literal annotation (alone or with None) allows; None for any other."""
    for candidate in (annotation, *get_args(annotation)):
        if get_origin(candidate) is Literal:
            return get_args(candidate)
    return None


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
    from pagedbatch.settings import unknown_variables

    settings = settings_from_args(args)
    configure_logging(settings.log_format)
    for name in unknown_variables(os.environ):
        logger.warning("%s names no setting and is ignored (see docs/configuration.md)", name)
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


WORKER_DESCRIPTION = """\
A worker of the distributed deployment: one engine, taking batch work from the broker (Celery on
Redis) and realtime requests from the API, and running upkeep. It rides out broker restarts and
outages of any length, reconnecting and going on taking tasks, and restarts of PostgreSQL and S3.
Run it under a supervisor that starts it again whenever it exits (compose.yaml's `restart:
unless-stopped`, systemd's `Restart=always`, a Kubernetes Deployment): it exits with status 70
when its engine dies, and whatever else ends it, it must come back the same way. Nothing is lost
meanwhile: other workers' upkeep re-leases its shards, and it resumes where the job store says."""


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
    from pagedbatch.make_model import long_context, make_model

    overrides = None
    if args.max_position_embeddings is not None:
        if args.arch not in ("llama", "qwen2", "mistral"):
            raise SystemExit("--max-position-embeddings: for llama, qwen2 and mistral")
        try:
            overrides = long_context(args.size, args.max_position_embeddings, args.rope_scaling)
        except ValueError as e:
            raise SystemExit(f"--max-position-embeddings: {e}") from None
    try:
        path = make_model(
            args.dir,
            arch=args.arch,
            size=args.size,
            seed=args.seed,
            config_overrides=overrides,
            task=args.task,
        )
    except ValueError as e:
        raise SystemExit(f"make-model: {e}") from None
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
    p.add_argument(
        "--task",
        choices=("generate", "classify", "guard", "embed"),
        default="generate",
        help="classify: a sequence classifier scoring OpenAI's 13 moderation categories; "
        "guard: a causal LM with a Llama-Guard-shaped template (safe/unsafe, hazard codes); "
        "embed: an embedding model in sentence-transformers' layout, last-token pooling "
        "(llama, qwen2; --arch bert is always a mean-pooling one)",
    )
    p.add_argument(
        "--max-position-embeddings",
        type=int,
        help="the model's context; past the size's own (tiny's 2048), with RoPE scaling",
    )
    p.add_argument(
        "--rope-scaling",
        choices=("yarn", "llama3", "linear"),
        default="yarn",
        help="how RoPE reaches a longer context (default: yarn)",
    )
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

    p = sub.add_parser(
        "worker",
        help="start a GPU worker of the distributed deployment (under a supervisor)",
        description=WORKER_DESCRIPTION,
    )
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
