"""Assembling the service from settings."""

from __future__ import annotations

from pagedbatch.service import start_engine
from pagedbatch.settings import Settings


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
