"""benchmarks/embeddings.py runs end to end on a few sentences (so that it cannot rot unnoticed),
its corpus is the one the README's figures were measured on, and its agreement figure counts
what parts from the peer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from commands import python_output
from embeddings import corpus, cosines
from harness import last_json_line

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "embeddings.py"


def test_the_corpus_is_fixed_by_its_seed_with_sentences_of_5_to_40_words() -> None:
    sentences = corpus(2_000, seed=0)
    assert sentences == corpus(2_000, seed=0)
    assert sentences != corpus(2_000, seed=1)
    words = [len(s.split()) for s in sentences]
    assert min(words) == 5 and max(words) == 40
    assert len(set(sentences)) == len(sentences)


def test_a_run_on_50_sentences_reports_our_engines_figures(
    make_checkpoint: Callable[..., Path],
) -> None:
    model = make_checkpoint("bert")
    config = json.loads((model / "config.json").read_text())
    args = ["--model", str(model), "--sentences", "50", "--warmup", "4", "--quiet-wait", "0"]
    report = last_json_line(python_output(str(SCRIPT), *args, "--peers", "none", timeout=120))
    assert report is not None

    assert report["workload"]["sentences"] == 50
    assert report["workload"]["tokens"] >= 50 * 7  # at least 5 words, [CLS] and [SEP]
    ours = report["ours"]
    assert ours["sentences_per_s"] > 0, ours
    assert ours["dimensions"] == config["hidden_size"]
    assert ours["max_norm_error"] < 1e-5
    assert ours["engine_args"]["dtype"] == "float32"
    assert ours["engine_args"]["matmul_precision"] == "auto"
    assert ours["matmul_precision"] in ("highest", "bfloat16")  # what auto resolved to here
    assert ours["cpu_s"]["engine"] > 0


def test_cosines_count_every_vector_that_parts_from_the_peers(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ours = rng.standard_normal((8, 16)).astype(np.float32)
    peer = 3 * ours  # a vector's length does not matter, its direction does
    peer[5] += 0.05 * rng.standard_normal(16).astype(np.float32)
    np.save(tmp_path / "ours.npy", ours)
    np.save(tmp_path / "peer.npy", peer)

    found = cosines(tmp_path, "ours", "peer")

    assert found is not None
    assert found["below_0.9999"] == 1
    assert found["min"] < 0.9999 < found["mean"]
    assert cosines(tmp_path, "ours", "absent") is None
