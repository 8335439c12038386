"""`LLM`: offline generation, or embedding, over a list of prompts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from pagedbatch.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagedbatch.engine.config import EngineArgs
from pagedbatch.engine.llm_engine import LLMEngine
from pagedbatch.engine.multimodal.inputs import MediaItem, place
from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.pooling_params import PoolingParams
from pagedbatch.engine.sampling_params import RequestOutputKind, SamplingParams

# Text or token ids; or, for a multimodal model, a dict of one of those ("prompt") and the
# images ("images", PIL images) or audio clips ("audio", (waveform, sampling rate) pairs) that
# fill its placeholder tokens in order.
Prompt = str | list[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str, **engine_args: Any):
        self.engine = LLMEngine(EngineArgs(model=str(model), **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in the prompts' order, whatever the params'
        `output_kind` (they run as FINAL_ONLY: no output is built before). The prompts share
        prefix-cache blocks with requests of the same `cache_salt` only (see
        LLMEngine.add_request). `lora_name`, one for all prompts or one per prompt, picks the
        LoRA adapter each runs with (None: the base model)."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt, as text or token ids
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("give one priority per prompt")
        if lora_name is None or isinstance(lora_name, str):
            lora_name = [lora_name] * len(prompts)
        if len(lora_name) != len(prompts):
            raise ValueError("give one lora_name, or one per prompt")
        final = {
            id(params): replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
            for params in sampling_params
        }
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, sampling_params, strict=True)):
                prio = priority[i] if priority is not None else 0
                tokens, media = self._with_media(prompt)
                ids.append(
                    self.engine.add_request(
                        None,
                        tokens,
                        final[id(params)],
                        priority=prio,
                        cache_salt=cache_salt,
                        media=media,
                        lora_name=lora_name[i],
                    )
                )
        except ValueError:
            for request_id in ids:  # leave the engine as it was
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def embed(
        self,
        prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
        params: PoolingParams | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """An embedding model's vectors (each output's `embedding`), in the prompts' order.
        Texts are tokenized as sentence-transformers does, with the tokenizer's special tokens
        ([CLS] ... [SEP] for BERT), all at once."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("give one priority per prompt")
        params = replace(params or PoolingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
        texts = [i for i, prompt in enumerate(prompts) if isinstance(prompt, str)]
        token_ids = list(prompts)
        if texts:  # one call: the fast tokenizer encodes a batch in parallel, in Rust
            encoded = self.tokenizer(
                [prompts[i] for i in texts],
                add_special_tokens=True,
                return_attention_mask=False,
                return_token_type_ids=False,
            )
            for i, ids in zip(texts, encoded["input_ids"], strict=True):
                token_ids[i] = ids
        ids = []
        try:
            for i, prompt in enumerate(token_ids):
                prio = priority[i] if priority is not None else 0
                ids.append(self.engine.add_request(None, prompt, params, priority=prio))
        except ValueError:
            for request_id in ids:  # leave the engine as it was
                self.engine.abort_request(request_id)
            self.engine.step()
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self, prompts: Sequence[Prompt], params: BeamSearchParams
    ) -> list[BeamSearchOutput]:
        """Each prompt's `beam_width` best beams (see `beam_search`), as vLLM's `LLM.beam_search`:
        prompts as text, token ids or `{"prompt": ...}` / `{"prompt_token_ids": [...]}` dicts.
        Every live beam of every prompt runs in one engine batch a step."""
        tokenizer = self.tokenizer
        searches = [
            BeamSearch(self._prompt_ids(prompt), params, self.engine.eos_token_ids)
            for prompt in prompts
        ]
        while live := [search for search in searches if not search.done]:
            beams = [beam for search in live for beam in search.prompts()]
            outputs = iter(self.generate(beams, live[0].step_params))
            for search in live:
                search.advance([next(outputs).logprobs[0] for _ in search.live])

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        return [search.output(decode) for search in searches]

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def _with_media(self, prompt: Prompt) -> tuple[str | list[int], tuple[MediaItem, ...]]:
        """The prompt as the engine takes it, and its images and clips placed in it."""
        if not isinstance(prompt, dict):
            return prompt, ()
        text = prompt["prompt"]
        images, clips = prompt.get("images") or [], prompt.get("audio") or []
        image_processor = self.engine.image_processor
        audio_processor = self.engine.audio_processor
        if images and image_processor is None:
            raise ValueError("this model takes no images")
        if clips and audio_processor is None:
            raise ValueError("this model takes no audio")
        media = [image_processor(image) for image in images]
        media += [audio_processor(waveform, rate) for waveform, rate in clips]
        if not media:
            return text, ()
        ids = (
            self.tokenizer.encode(text, add_special_tokens=True) if isinstance(text, str) else text
        )
        ids, items = place(list(ids), media)
        return ids, tuple(items)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), disable=not use_tqdm, unit="req") as bar:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        done[output.request_id] = output
                        bar.update(1)
        return [done[i] for i in ids]

    def abort(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    def get_stats(self) -> dict:
        return self.engine.get_stats()

    def shutdown(self) -> None:
        """Stops the engine's other tensor-parallel ranks, if any."""
        self.engine.shutdown()
