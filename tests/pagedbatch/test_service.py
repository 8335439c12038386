"""Assembling the service from settings."""

from __future__ import annotations

import dataclasses

from lora_adapters import make_adapter

from pagedbatch.service import start_engine
from pagedbatch.settings import ENGINE_SETTINGS, Settings


def test_the_kv_cache_memory_setting_sizes_the_engines_cache(make_checkpoint, tmp_path):
    settings = Settings(
        model=str(make_checkpoint("llama")), data_dir=tmp_path, kv_cache_memory_gib=0.01
    )
    llm = start_engine(settings)
    try:
        engine = llm.engine
        expected = int(0.01 * 2**30 // engine.runner.kv_bytes_per_block)
        assert engine.get_stats()["total_kv_blocks"] == expected
    finally:
        llm.shutdown()


def test_the_engine_runs_with_every_engine_setting(tiny_llama, tmp_path):
    given = {
        "model": str(tiny_llama),
        "served_model_name": "tiny",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        "reasoning_parser": "none",
        "dtype": "float32",
        "matmul_precision": "highest",
        "quantization": "none",
        "device": "cpu",
        "cuda_graphs": False,
        "max_model_len": 512,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "block_size": 8,
        "num_kv_blocks": 64,  # max_model_len's 512 tokens, whole
        "kv_cache_memory_gib": 0.1,
        "enable_prefix_caching": False,
        "scheduling_policy": "fcfs",
        "low_priority_token_budget": 32,
        "realtime_target_itl_ms": 40.0,
        "grammar_compile_seconds": 3.0,
        "max_images_per_request": 2,
        "max_image_bytes": 1000,
        "max_image_pixels": 10_000,
        "max_audio_clips_per_request": 2,
        "max_audio_bytes": 5000,
        "max_audio_seconds": 5.0,
        "media_allowed_hosts": "images.example.com",
        "media_fetch_deadline_seconds": 4.0,
        "max_num_encoder_tokens": 64,
        "encoder_cache_size": 128,
        "tensor_parallel_size": 1,
        "kv_cache_dtype": "int8",
        "enable_lora": True,
        "lora_modules": f"tiny-r8={make_adapter(tiny_llama, tmp_path / 'r8', 8, 16, ['q_proj'])}",
        "max_loras": 2,
        "max_cpu_loras": 3,
        "max_lora_rank": 8,
        "seed": 7,
        "stats_log_interval_seconds": 0.5,
    }
    assert set(given) == set(ENGINE_SETTINGS)  # a new setting belongs here too
    llm = start_engine(Settings(data_dir=tmp_path, **given))
    try:
        engine = llm.engine
        assert dataclasses.asdict(engine.args) == given
        assert engine.max_model_len == 512
        assert engine.get_stats()["total_kv_blocks"] == 64
    finally:
        llm.shutdown()
