"""PoolingConfig: an embedding model's pooling as its sentence-transformers files say (both the
older pooling_mode_* flags and sentence-transformers 6's pooling_mode), or its architecture
implies; what the engine cannot pool as the model was trained is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedbatch.engine import PoolingConfig

BERT = {"architectures": ["BertModel"], "hidden_size": 64}
ST = "sentence_transformers.models."


def model_dir(
    tmp_path: Path, pooling: dict | None, *kinds: str, sentence_bert: dict | None = None
) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST + "Transformer"}]
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": ST + "Pooling"})
    modules += [{"idx": 2 + i, "name": k, "path": "", "type": ST + k} for i, k in enumerate(kinds)]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if sentence_bert is not None:
        (tmp_path / "sentence_bert_config.json").write_text(json.dumps(sentence_bert))
    return tmp_path


def test_sentence_transformers_6_names_its_mode_and_size(tmp_path):
    path = model_dir(
        tmp_path,
        {"embedding_dimension": 48, "pooling_mode": "cls", "include_prompt": True},
        sentence_bert={"max_seq_length": 128},
    )
    config = PoolingConfig.load(path, BERT)
    assert config == PoolingConfig("cls", False, 48, None, 128)


def test_the_older_flags_and_a_normalize_module(tmp_path):
    path = model_dir(tmp_path, {"pooling_mode_lasttoken": True}, "Normalize")
    config = PoolingConfig.load(path, BERT | {"matryoshka_dimensions": [64, 32]})
    assert (config.pooling_type, config.normalize, config.dimensions) == ("last", True, 64)
    assert config.matryoshka_dimensions == (64, 32)
    assert config.check_dimensions(32) == 32 and config.check_dimensions(None) == 64


@pytest.mark.parametrize(
    ("pooling", "kinds", "refused"),
    [
        ({"pooling_mode_max_tokens": True}, (), "pooling_mode_max_tokens is not supported"),
        ({"pooling_mode": "weightedmean"}, (), "pooling mode weightedmean is not supported"),
        ({"pooling_mode": ["cls", "mean"]}, (), "one pooling mode is supported"),
        ({"pooling_mode": "mean", "include_prompt": False}, (), "include_prompt"),
        ({"pooling_mode": "mean"}, ("Dense",), "modules Dense are not supported"),
    ],
)
def test_what_cannot_be_pooled_as_trained_is_refused(tmp_path, pooling, kinds, refused):
    with pytest.raises(ValueError, match=refused):
        PoolingConfig.load(model_dir(tmp_path, pooling, *kinds), BERT)


def test_without_sentence_transformers_files_the_architecture_decides(tmp_path):
    assert PoolingConfig.load(tmp_path, BERT) == PoolingConfig("cls", True, 64, None)
    qwen2 = {"architectures": ["Qwen2Model"], "hidden_size": 32, "is_matryoshka": True}
    config = PoolingConfig.load(tmp_path, qwen2)
    assert (config.pooling_type, config.matryoshka_dimensions) == ("last", ())
    assert config.check_dimensions(7) == 7  # any size up to the model's
    # A causal LM without a pooling config generates.
    assert PoolingConfig.load(tmp_path, {"architectures": ["LlamaForCausalLM"]}) is None
