"""`run_batch`: a batch input file through a local checkpoint into an output file."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
from tqdm import tqdm

import pagedbatch.run_batch
from pagedbatch.engine import LLM, SamplingParams
from pagedbatch.run_batch import run_batch

QUESTIONS = ["What is red?", "Count to three.", "Say hi.", "Why is the sky blue?"]


def write_input(path: Path, model: str) -> None:
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": question}],
                "temperature": 0,
                "max_completion_tokens": 6,
            },
        }
        for i, question in enumerate(QUESTIONS)
    ]
    lines.append(
        {
            "custom_id": "story",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": "Once upon a time", "max_tokens": 5},
        }
    )
    text = "\n".join(json.dumps(line) for line in lines)
    path.write_text(text + '\n{"custom_id": "broken",\n\n')


def test_run_batch(tiny_llama, tmp_path, capsys):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    model = Path(tiny_llama).resolve().name  # the served name defaults to the directory's name
    write_input(source, model)

    progress = run_batch(source, target, tiny_llama, max_num_seqs=2, num_kv_blocks=128)

    results = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(results) == 6 == progress.lines_done
    assert progress.lines_failed == 1
    by_id = {r["custom_id"]: r for r in results}
    assert set(by_id) == {"q0", "q1", "q2", "q3", "story", None}
    for result in results:
        assert set(result) == {"id", "custom_id", "response", "error"}
    assert by_id[None]["response"] is None
    assert by_id[None]["error"]["code"] == "invalid_json_line"

    llm = LLM(str(tiny_llama), num_kv_blocks=128)
    templates = [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    prompts = [llm.tokenizer.encode(t, add_special_tokens=False) for t in templates]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    generated = 0
    for i, (prompt, output) in enumerate(zip(prompts, expected, strict=True)):
        response = by_id[f"q{i}"]["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["choices"][0]["message"]["content"] == output.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(prompt)
        assert body["usage"]["completion_tokens"] == len(output.outputs[0].token_ids)
        generated += body["usage"]["completion_tokens"]
    story = by_id["story"]["response"]["body"]
    assert story["object"] == "text_completion"
    assert story["usage"]["prompt_tokens"] == len(llm.tokenizer.encode("Once upon a time"))
    assert progress.generated_tokens == generated + story["usage"]["completion_tokens"]

    bar = capsys.readouterr().err
    assert "6/6" in bar
    assert "tok/s" in bar


def test_the_progress_bar_shows_lines_tokens_per_second_and_eta(
    tiny_llama, tmp_path, capsys, monkeypatch
):
    # Every update drawn (tqdm draws at most every 0.1 s), so that the frames of the lines
    # between the first and the last are there to read however fast the machine is.
    monkeypatch.setattr(pagedbatch.run_batch, "tqdm", partial(tqdm, mininterval=0))
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    line = {"method": "POST", "url": "/v1/completions"}
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 8, "ignore_eos": True}
    source.write_text(
        "\n".join(json.dumps({**line, "custom_id": f"r{i}", "body": body}) for i in range(4))
    )

    run_batch(source, target, tiny_llama, served_model_name="tiny", max_num_seqs=1)

    frames = [frame.strip() for frame in capsys.readouterr().err.split("\r") if frame.strip()]
    pattern = re.compile(
        r"(\d)/4 lines \[\d\d:\d\d elapsed, ETA (\d\d:\d\d|\?), ([\d.]+) tok/s, 0 failed\]$"
    )
    shown = [match.groups() for frame in frames if (match := pattern.search(frame))]
    midway = [(done, eta, rate) for done, eta, rate in shown if done in "123"]
    assert {done for done, _, _ in midway} == {"1", "2", "3"}
    # Once a line has finished, the ETA is a time and tokens are flowing.
    assert all(eta != "?" and float(rate) > 0 for _, eta, rate in midway)
    assert shown[-1][0] == "4"


def test_run_batch_screens_lines_as_the_service_settings_say(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDBATCH_SAFETY_POLICY", "input")
    monkeypatch.setenv("PAGEDBATCH_SAFETY_BLOCKLIST", '["forbidden"]')
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    model = Path(tiny_llama).resolve().name
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": 3},
        }
        for custom_id, prompt in (("clean", "Once upon a time"), ("refused", "Say forbidden"))
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch(source, target, tiny_llama, show_progress=False, num_kv_blocks=128)
    results = {r["custom_id"]: r["response"] for r in map(json.loads, target.open())}
    assert results["clean"]["status_code"] == 200
    refused = results["refused"]
    assert (refused["status_code"], refused["body"]["error"]["code"]) == (400, "content_filter")


def test_run_batch_embeds_on_the_embedding_model_unscreened(
    tiny_llama, make_checkpoint, tmp_path, monkeypatch
):
    bert = make_checkpoint("bert")
    monkeypatch.setenv("PAGEDBATCH_EMBEDDING_MODEL", str(bert))
    # Neither way is an embedding screened: nothing is generated for anyone to read.
    monkeypatch.setenv("PAGEDBATCH_SAFETY_POLICY", "both")
    monkeypatch.setenv("PAGEDBATCH_SAFETY_BLOCKLIST", '["forbidden"]')
    texts = ["A first sentence.", "Something forbidden.", "Third."]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": bert.name, "input": text, "encoding_format": "float"},
        }
        for i, text in enumerate(texts)
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    progress = run_batch(source, target, tiny_llama, show_progress=False, num_kv_blocks=64)
    assert (progress.lines_done, progress.lines_failed, progress.generated_tokens) == (3, 0, 0)
    bodies = {r["custom_id"]: r["response"]["body"] for r in map(json.loads, target.open())}
    expected = LLM(str(bert)).embed(texts)
    for i, output in enumerate(expected):
        [item] = bodies[f"e{i}"]["data"]
        assert item["embedding"] == pytest.approx(output.embedding.tolist(), abs=1e-5)
        assert bodies[f"e{i}"]["usage"]["prompt_tokens"] == len(output.prompt_token_ids)
