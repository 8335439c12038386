"""The engine loop: input processing, the core step, output processing, and the step's loggers.

Each `add_request` goes through the `InputProcessor` (checks, the `n` completions), is followed
by the `OutputProcessor` and admitted by the `EngineCore`. Each `step` enforces deadlines, runs
one core step (schedule, run, sample), turns it into outputs, and hands its one `StepStats` to
every logger on `loggers`. Only one thread drives an engine.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from pagedbatch.engine.config import EngineArgs, ModelConfig, PoolingConfig, default_model_name
from pagedbatch.engine.core.scheduler import Scheduler
from pagedbatch.engine.engine_core import EngineCore
from pagedbatch.engine.input_processor import InputProcessor
from pagedbatch.engine.lora.adapter import LoraAdapter
from pagedbatch.engine.lora.registry import LoraInUse, LoraNameError, UnknownLora
from pagedbatch.engine.metrics.engine_stats import EngineStats
from pagedbatch.engine.metrics.prometheus import EngineMetrics
from pagedbatch.engine.metrics.stats_line import StatsLogger
from pagedbatch.engine.metrics.step import StatLogger
from pagedbatch.engine.multimodal.audio import AudioLimits, AudioProcessor, audio_spec
from pagedbatch.engine.multimodal.images import ImageLimits, ImageProcessor, image_spec
from pagedbatch.engine.multimodal.inputs import MediaItem
from pagedbatch.engine.output_processor import OutputProcessor
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.pooling_params import PoolingParams
from pagedbatch.engine.sample.grammar_runtime import GrammarRuntime
from pagedbatch.engine.sampling_params import SamplingParams
from pagedbatch.engine.tokenizer import eos_token_ids, load_tokenizer, reasoning_tags
from pagedbatch.engine.worker.model_runner import ModelRunner
from pagedbatch.engine.worker.resident import ResidentSize

logger = logging.getLogger(__name__)

# A LoRA adapter's name is a model name in requests and listings: bounded like an id.
MAX_LORA_NAME = 256


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.model_config = ModelConfig.load(args.model)
        self.model_name = args.served_model_name or default_model_name(args.model)
        self.labels = self.model_config.labels  # a sequence classifier's; None otherwise
        # An embedding model's pooling (it takes PoolingParams only); None: a model that
        # generates (SamplingParams only).
        self.pooling: PoolingConfig | None = self.model_config.pooling
        meta = self.model_config.metadata_dir
        self.tokenizer = load_tokenizer(meta, args.chat_template)
        self.eos_token_ids = eos_token_ids(meta, self.tokenizer)
        # What a reasoning model thinks between, for chat answers to split at; None: no split.
        self.reasoning_tags = reasoning_tags(self.tokenizer, args.reasoning_parser)
        limit = self.model_config.max_position_embeddings
        if self.pooling is not None and self.pooling.max_seq_length:
            # What sentence-transformers cuts inputs to: the length the model was trained on.
            limit = min(limit, self.pooling.max_seq_length)
        if args.max_model_len is not None and args.max_model_len > limit:
            raise ValueError(f"max_model_len {args.max_model_len} exceeds the model's {limit}")
        if self.model_name in args.lora_paths():
            raise ValueError(
                f"LoRA adapter {self.model_name!r} has the model's own name: requests could "
                "not pick the model"
            )
        self.core = EngineCore(self.model_config, args, self.tokenizer, self.eos_token_ids)
        try:
            self.max_model_len = self._max_model_len(limit)
        except ValueError:
            self.core.runner.shutdown()
            raise
        # What the model holds in memory (rank 0's share), as get_stats() reports it.
        self.resident = ResidentSize.of(self.runner.model, self.runner.kv_caches)
        logger.info("%s resident: %s", self.model_name, self.resident.describe())
        # For callers to make images and clips ready with, off the engine thread; None: the
        # model takes none.
        self.image_processor: ImageProcessor | None = None
        self.audio_processor: AudioProcessor | None = None
        if image_spec(self.model_config) is not None:
            hosts = (args.media_allowed_hosts or "").lower().split(",")
            limits = ImageLimits(
                args.max_images_per_request,
                args.max_image_bytes,
                args.max_image_pixels,
                tuple(host.strip() for host in hosts if host.strip()),
                args.media_fetch_deadline_seconds,
            )
            self.image_processor = ImageProcessor(self.model_config, limits)
        if audio_spec(self.model_config) is not None:
            self.audio_processor = AudioProcessor(
                self.model_config,
                AudioLimits(
                    args.max_audio_clips_per_request, args.max_audio_bytes, args.max_audio_seconds
                ),
            )
        processors = (self.image_processor, self.audio_processor)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.model_config.vocab_size,
            self.max_model_len,
            self.eos_token_ids,
            [p.spec for p in processors if p is not None],
            min(args.max_num_encoder_tokens, args.encoder_cache_size),
            self.pooling,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.core)
        self.stats = EngineStats()  # what get_stats() reports
        self.loggers: list[StatLogger] = [
            self.stats,
            EngineMetrics(self.model_name, self.core.kv, self.core.scheduler),
        ]
        if args.stats_log_interval_seconds:
            self.loggers.append(StatsLogger(self.model_name, args.stats_log_interval_seconds))
        self._ids = itertools.count()
        torch.manual_seed(args.seed)

    def _max_model_len(self, model_len: int) -> int:
        """The longest context a request may have: the one asked for, which the KV cache must
        hold whole, or else the model's, as far as the KV cache holds. An encoder keeps no KV
        cache, but runs each sequence whole in one step: its context is what a step holds."""
        if self.model_config.encoder_only:
            return self._encoder_max_model_len(model_len)
        pool = self.core.kv.pool
        held = pool.num_blocks * self.args.block_size
        asked = self.args.max_model_len
        if asked is not None and asked > held:
            raise ValueError(
                f"max_model_len {asked} does not fit the KV cache, which holds {held} tokens "
                f"({pool.num_blocks} blocks of {self.args.block_size}): raise "
                "kv_cache_memory_gib (or num_kv_blocks), or lower max_model_len"
            )
        if asked is None and held < model_len:
            logger.warning(
                "max_model_len is %d, what the KV cache holds, below the model's %d: raise "
                "kv_cache_memory_gib for longer contexts",
                held,
                model_len,
            )
        return asked or min(model_len, held)

    def _encoder_max_model_len(self, model_len: int) -> int:
        step = self.args.max_num_batched_tokens
        asked = self.args.max_model_len
        if asked is not None and asked > step:
            raise ValueError(
                f"max_model_len {asked} exceeds max_num_batched_tokens {step}: an encoder runs "
                "each sequence whole in one step; raise max_num_batched_tokens"
            )
        if asked is None and step < model_len:
            logger.warning(
                "max_model_len is %d, max_num_batched_tokens, below the model's %d: an encoder "
                "runs each sequence whole in one step",
                step,
                model_len,
            )
        return asked or min(model_len, step)

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters served, by the names requests give."""
        loras = self.runner.loras
        return () if loras is None else loras.names

    def read_lora(self, name: str, path: Path) -> LoraAdapter:
        """The adapter in PEFT folder `path`, read and checked against the model to be served
        as `name` (ValueError naming what is wrong). Reads only what the engine fixed at start:
        callers may run it off the engine thread, then `add_lora` on it."""
        loras = self.runner.loras
        if loras is None:
            raise ValueError("LoRA adapters are not enabled: start with enable_lora")
        self._check_lora_name(name)
        return loras.registry.read(name, path)

    def add_lora(self, adapter: LoraAdapter, path: Path) -> None:
        """Serves `adapter` (from `read_lora`), read from `path`; ValueError where its name is
        taken meanwhile."""
        self._check_lora_name(adapter.name)
        self.runner.loras.registry.add(adapter, path)

    def load_lora(self, name: str, path: Path) -> None:
        self.add_lora(self.read_lora(name, path), path)

    def unload_lora(self, name: str) -> None:
        """Stops serving adapter `name`: UnknownLora where none is loaded by that name,
        LoraInUse while requests that have not finished run with it (they are not cut short;
        unload it once they are done)."""
        loras = self.runner.loras
        if loras is None or name not in loras.names:
            raise UnknownLora(f"LoRA adapter {name!r} is not loaded")
        users = sum(1 for r in self.outputs.live_requests() if r.lora_name == name)
        if users:
            raise LoraInUse(f"LoRA adapter {name!r} has {users} unfinished requests")
        loras.remove(name)

    def _check_lora_name(self, name: str) -> None:
        if not name or not name.strip() or len(name) > MAX_LORA_NAME:
            raise LoraNameError(f"a LoRA adapter's name is 1 to {MAX_LORA_NAME} characters")
        if name == self.model_name:
            raise LoraNameError(f"LoRA adapter {name!r} has the model's own name")
        if name in self.lora_names:
            raise LoraNameError(f"LoRA adapter {name!r} is already loaded")

    # The core's parts that callers look at.
    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def grammars(self) -> GrammarRuntime:
        return self.core.grammars

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        priority: int = 0,
        timeout: float | None = None,
        cache_salt: str | None = None,
        media: tuple[MediaItem, ...] = (),
        user_priority: int = 0,
        lora_name: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError naming the problem if it cannot run. An embedding
        model (`pooling`) takes PoolingParams, any other SamplingParams; None: the defaults of
        the kind the model takes. `lora_name` picks one of the LoRA adapters served
        (`lora_modules`); None: the base model alone.

        Requests share prefix-cache blocks only when their `cache_salt`s are equal (None
        included): a tenant's salt keeps others from learning, through cached_tokens, what it sent.
        A multimodal model's `media` come from `image_processor` and `audio_processor`, placed
        in the prompt by `multimodal.place`. `user_priority` (vLLM's request priority, -1000 to
        1000) orders requests within their `priority`, lower first.
        """
        params = params or self.default_params()
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.outputs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_name is not None and lora_name not in self.lora_names:
            served = ", ".join(self.lora_names) or "none"
            raise ValueError(f"unknown LoRA adapter {lora_name!r}; served: {served}")
        completions = self.inputs.process(
            request_id, prompt, params, priority, timeout, cache_salt, media, user_priority
        )
        lora_id = 0 if lora_name is None else self.runner.loras.lora_id(lora_name)
        for completion in completions:
            completion.lora_name, completion.lora_id = lora_name, lora_id
        self.outputs.add(request_id, completions)
        self.core.add(
            completions, params.structured if isinstance(params, SamplingParams) else None
        )
        return request_id

    def default_params(self) -> SamplingParams | PoolingParams:
        """What a request without params runs with: PoolingParams() on an embedding model."""
        return PoolingParams() if self.pooling is not None else SamplingParams()

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its completions). Returns False if it is unknown or done."""
        return self.outputs.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.outputs.has_unfinished_requests

    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks, if any; the engine runs no more."""
        self.runner.shutdown()

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests that moved, as each
        request's `output_kind` asks."""
        began = time.monotonic()
        self.outputs.expire_deadlines(began)
        outputs, stats = self.outputs.process(self.core.step(), began)
        if not self.has_unfinished_requests():
            self.core.pause()
        for logger in self.loggers:
            logger.record(stats)
        return outputs

    def idle(self) -> None:
        """For a loop that waits for work: lets the stats line of the last burst out on time."""
        now = time.monotonic()
        for logger in self.loggers:
            logger.idle(now)

    def _encoder_stats(self) -> dict:
        cache = self.core.encoder_cache
        if cache is None:
            return {}
        return {"media_encoded": cache.media_encoded, "encoder_cache_hits": cache.cache_hits}

    def get_stats(self) -> dict:
        pool = self.core.kv.pool
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_kv_blocks": pool.num_free_blocks,
            "total_kv_blocks": pool.num_blocks,
            "kv_usage": pool.usage,
            "kv_blocks_ever_used": pool.blocks_ever_used,
            "kv_bytes_per_block": self.core.runner.kv_bytes_per_block,
            "resident": self.resident.as_dict(),
            "prefix_cache_queries": pool.prefix_queries,
            "prefix_cache_hits": pool.prefix_hits,
            "preemptions": self.scheduler.num_preemptions,
            **self._encoder_stats(),
            **self.stats.as_dict(),
        }
