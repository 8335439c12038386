"""benchmarks/lora.py runs end to end, ours only, on the tiny model (so that it cannot rot
unnoticed), and its figures are what its docstring says they are."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from commands import python_output
from harness import last_json_line
from lora import comparisons

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora.py"


def test_a_quick_run_reports_ours_with_and_without_adapters(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    model = make_checkpoint("llama")
    args = ["--quick", "--model", str(model), "--requests", "6", "--adapters", "3"]
    args += ["--adapter-dir", str(tmp_path)]
    report = last_json_line(python_output(str(SCRIPT), *args, timeout=600))
    assert report is not None

    assert report["workload"]["requests"] == 6 and report["workload"]["adapters"] == 3
    base, lora = report["ours_base"], report["ours_lora"]
    for figures in (base, lora):
        assert figures["output_tps"] > 0, figures
        assert figures["wrong_lengths"] == 0
        assert figures["output_tokens"] == report["workload"]["output_tokens"]
    assert "lora_modules" not in base["engine_args"]
    assert lora["engine_args"]["max_loras"] == 3
    assert lora["engine_args"]["lora_modules"].count("=") == 3
    assert report["lora_overhead"] == round(base["output_tps"] / lora["output_tps"], 3)
    # random adapters on every linear: each request's answer differs from the base model's
    assert report["adapters_changed_answers"] > 0.5
    assert report["ratio_vs_vllm"] is None and "vllm_lora" not in report
    assert len(list(tmp_path.glob("lora-*/adapter_model.safetensors"))) == 3


def test_comparisons_divide_as_documented(tmp_path: Path) -> None:
    (tmp_path / "ours_base.json").write_text("[[1, 2], [3, 4]]")
    (tmp_path / "ours_lora.json").write_text("[[1, 2], [3, 5]]")
    (tmp_path / "vllm_lora.json").write_text("[[1, 2], [3, 6]]")
    report = {
        "ours_base": {"output_tps": 120.0},
        "ours_lora": {"output_tps": 100.0},
        "vllm_lora": {"output_tps": 80.0},
    }
    found = comparisons(report, tmp_path)
    assert found["lora_overhead"] == 1.2 and found["targets_met"]["lora_overhead"] is True
    assert found["ratio_vs_vllm"] == 1.25 and found["targets_met"]["ratio_vs_vllm"] is True
    assert found["vllm_lora_overhead"] is None
    assert found["adapters_changed_answers"] == 0.5
    assert found["greedy_agreement_vs_vllm"]["identical_requests"] == 0.5
    report["ours_lora"]["output_tps"] = 90.0
    assert comparisons(report, tmp_path)["targets_met"]["lora_overhead"] is False
