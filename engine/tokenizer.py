"""Loading a checkpoint's tokenizer and the token ids that end generation."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from pagedbatch.engine.worker.host_memory import release_freed_memory


def load_tokenizer(
    model_dir: str | Path, chat_template: str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside the checkpoint; never looks anything up online.

    `chat_template` (Jinja, or a file holding it) replaces the tokenizer's own, or gives one to a
    tokenizer without (a base model's GGUF, say)."""
    tokenizer = AutoTokenizer.from_pretrained(
        model_dir, config=_naming_config(Path(model_dir)), local_files_only=True
    )
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    # transformers keeps the Python vocabulary and merges its BPE tokenizer classes build their
    # Rust tokenizer from, which holds its own; nothing reads them after (Gemma 3's 262,144
    # tokens and 514,906 merges: 145 MiB).
    for built_from in ("_vocab", "_merges"):
        vars(tokenizer).pop(built_from, None)
    # Parsing tokenizer.json frees more than the tokenizer keeps (Gemma 3's: 180 MiB at its
    # peak, 91 kept), among what it keeps. Handed back now, before the weights load into that
    # heap: else Gemma 3's engine held 31 MiB more for good.
    release_freed_memory()
    return tokenizer


def _naming_config(model_dir: Path) -> PretrainedConfig | None:
    """What AutoTokenizer reads of the model's config to pick the tokenizer's class (its
    model_type, name and tokenizer_class), where tokenizer_config.json names the class itself and
    brings no code of its own; None elsewhere, and AutoTokenizer loads the config whole.

    Loading it whole builds the architecture's config class, whose module imports transformers'
    model-loading machinery (accelerate, boto3, torch.distributed.tensor, sympy: about 900
    modules): 65 MiB of the engine's resident memory and seconds of start-up for nothing the
    engine uses (SmolLM2's tokenizer: 111 MiB to load, 47 MiB with this)."""
    tokenizer_config, config = model_dir / "tokenizer_config.json", model_dir / "config.json"
    if not tokenizer_config.is_file() or not config.is_file():
        return None
    named = json.loads(tokenizer_config.read_text())
    if not named.get("tokenizer_class") or "auto_map" in named:
        return None
    raw = json.loads(config.read_text())
    if "model_type" not in raw:
        return None
    light = PretrainedConfig(name_or_path=str(model_dir))
    light.model_type = raw["model_type"]
    for key in ("tokenizer_class", "model_name"):
        if key in raw:
            setattr(light, key, raw[key])
    return light


THINK_TAGS = ("<think>", "</think>")


def reasoning_tags(tokenizer: PreTrainedTokenizerBase, parser: str) -> tuple[str, str] | None:
    """The tags a reasoning model thinks between, for EngineArgs.reasoning_parser: None for
    `none`, or for `auto` where the vocabulary lacks either; a named parser without them is a
    ValueError. Each tag must be one token: then no text the model writes around it can split or
    fake it."""
    if parser == "none":
        return None
    if all(_is_token(tokenizer, tag) for tag in THINK_TAGS):
        return THINK_TAGS
    if parser == "auto":
        return None
    raise ValueError(
        f"reasoning_parser {parser}: the model's vocabulary has no {THINK_TAGS[0]} and "
        f"{THINK_TAGS[1]} tokens"
    )


def _is_token(tokenizer: PreTrainedTokenizerBase, text: str) -> bool:
    """Whether `text` is a token of the vocabulary, asked of its id both ways: `get_vocab` would
    build a dict of the whole vocabulary, whose freed pages the weights then load among (Gemma
    3's 262,144 tokens: its engine held 32 MiB more for good)."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    return token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == text


def read_chat_template(value: str) -> str:
    """A template given inline, or the contents of the file it names."""
    if "{" not in value:  # every template has a {{ or {%; a path rarely has either
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"chat_template {value!r} is neither a Jinja template nor a file")
        return path.read_text(encoding="utf-8")
    return value


def eos_token_ids(model_dir: str | Path, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends generation: the model's (as `generate` reads them) and the tokenizer's.

    Chat models often end turns with a token other than the tokenizer's eos, and list it only
    in generation_config.json (or, in older checkpoints, config.json).
    """
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
            break
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
