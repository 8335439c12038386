"""More LoRA adapters than slots (issue 35), and adapters loaded and unloaded at run time.

Five adapters over `max_loras` 2 slots and `max_cpu_loras` 3 kept in host memory: 20 requests at
once over them and the base model. No step holds more than two adapters, slots are reused
(adapters swapped in and out), folders are read again once they fall out of host memory, and
each request's greedy tokens equal transformers + peft float32's for its adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
from greedy_checks import GREEDY, random_prompts
from lora_adapters import ATTENTION, MLP, make_adapter
from lora_adapters import peft_greedy as oracle_greedy

from pagedbatch.engine import LLMEngine
from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.lora.registry import LoraInUse, LoraNameError, UnknownLora

SPECS = [
    (8, 16, ATTENTION + MLP),
    (16, 8, ATTENTION),
    (8, 8, ["q_proj", "v_proj", *MLP]),
    (4, 8, MLP),
    (16, 32, ["o_proj", "down_proj"]),
]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        f"ad{i}": make_adapter(tiny_llama, tmp_path_factory.mktemp(f"ad{i}"), *spec, seed=20 + i)
        for i, spec in enumerate(SPECS)
    }


def peft_greedy(model_dir: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    return oracle_greedy(model_dir, adapter, prompt, GREEDY.max_tokens)


def test_twenty_requests_over_five_adapters_and_two_slots_match_peft(tiny_llama, adapters):
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    args = EngineArgs(
        model=str(tiny_llama),
        lora_modules=modules,
        max_loras=2,
        max_cpu_loras=3,
        max_num_seqs=8,
        num_kv_blocks=256,
    )
    engine = LLMEngine(args)
    loras = engine.runner.loras
    prompts = random_prompts(20, 3, 30, seed=31)
    names = [None, *adapters]
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    for i, (prompt, name) in enumerate(zip(prompts, chosen, strict=True)):
        engine.add_request(f"r{i}", prompt, GREEDY, lora_name=name)
    outputs = {}
    most = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        most = max(most, len(loras.step.current.slots))
        assert len(loras.resident()) <= 2
    assert most == 2  # two adapters shared steps, never more
    assert loras.swaps > 5  # slots were reused
    assert loras.registry.reads > 5  # folders read again after leaving host memory
    expected = [
        peft_greedy(tiny_llama, None if name is None else adapters[name], prompt)
        for name, prompt in zip(chosen, prompts, strict=True)
    ]
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == expected


def test_adapters_load_and_unload_at_run_time(tiny_llama, adapters, tmp_path):
    engine = LLMEngine(
        EngineArgs(model=str(tiny_llama), enable_lora=True, max_loras=1, num_kv_blocks=128)
    )
    prompt = random_prompts(1, 40, 40, seed=32)[0]  # two full blocks of 16 tokens
    first, second = adapters["ad0"], adapters["ad1"]

    def run(name: str | None) -> tuple[list[int], int]:
        request_id = engine.add_request(None, prompt, GREEDY, lora_name=name)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id and output.finished:
                    done = output
        return done.outputs[0].token_ids, done.num_cached_tokens

    assert engine.lora_names == ()
    engine.load_lora("x", first)
    assert run("x") == (peft_greedy(tiny_llama, first, prompt), 0)
    assert run("x")[1] == 32
    with pytest.raises(LoraNameError, match="'x' is already loaded"):
        engine.load_lora("x", second)
    with pytest.raises(LoraNameError, match="the model's own name"):
        engine.load_lora(engine.model_name, second)
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        engine.load_lora("y", tmp_path)
    assert engine.lora_names == ("x",)

    # Not while a request runs with it; then it goes, and its name is unknown.
    engine.add_request("busy", prompt, GREEDY, lora_name="x")
    engine.step()
    with pytest.raises(LoraInUse, match="'x' has 1 unfinished requests"):
        engine.unload_lora("x")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora("x")
    with pytest.raises(UnknownLora):
        engine.unload_lora("x")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'x'"):
        engine.add_request(None, prompt, GREEDY, lora_name="x")

    # The name again, other weights: none of the first one's cached blocks are reused.
    engine.load_lora("x", second)
    assert run("x") == (peft_greedy(tiny_llama, second, prompt), 0)
    assert run(None)[0] == peft_greedy(tiny_llama, None, prompt)
