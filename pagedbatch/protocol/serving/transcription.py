"""`/v1/audio/transcriptions`: an audio file in, its words out.

The audio model hears the clip in a chat turn of its own template: the clip, then an instruction
to write down what is said (in the language given, with the prompt's words as context), as one
asks Qwen2-Audio's instruct models to transcribe. A clip is at most the model's window (30 s);
the transcript at most one token per audio embedding (25 a second, several times the pace of
speech), so that a model that never stops still ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jinja2 import TemplateError

from pagedbatch.engine.outputs import RequestOutput
from pagedbatch.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedbatch.protocol.audio import decode_audio
from pagedbatch.protocol.errors import OpenAIError
from pagedbatch.protocol.schemas.audio import (
    InputTokenDetails,
    Transcription,
    TranscriptionRequest,
    TranscriptionUsage,
)
from pagedbatch.protocol.serving.common import (
    EngineInput,
    ServedModel,
    check_context_length,
    check_model,
    finish_reason,
    new_id,
    not_supported,
)
from pagedbatch.protocol.serving.media import place_media, process_audio

INSTRUCTION = "Write down exactly what is said in this audio, word for word."
LANGUAGE = " The speech is in the language with ISO 639 code '{language}'."
CONTEXT = " It may use these words: {prompt}"


@dataclass
class PreparedTranscription:
    request: TranscriptionRequest
    inputs: list[EngineInput]

    def input_texts(self) -> list[str]:
        return [self.request.prompt] if self.request.prompt else []

    def response(self, outputs: Sequence[RequestOutput]) -> Transcription | str:
        """The transcription, or its bare text for `response_format: "text"`."""
        (output,) = outputs
        (choice,) = output.outputs
        finish_reason(choice, output)  # raises for a failed or aborted request
        text = choice.text.strip()
        if self.request.response_format == "text":
            return text
        prompt, audio = len(output.prompt_token_ids), output.num_audio_tokens
        generated = len(choice.token_ids)
        return Transcription(
            text=text,
            usage=TranscriptionUsage(
                input_tokens=prompt,
                output_tokens=generated,
                total_tokens=prompt + generated,
                input_token_details=InputTokenDetails(
                    text_tokens=prompt - audio, audio_tokens=audio
                ),
            ),
        )


def prepare_transcription(
    request: TranscriptionRequest, served: ServedModel
) -> PreparedTranscription:
    """The engine request that transcribes the request's file; OpenAIError if it cannot be
    served."""
    check_model(request.model, served)
    if request.stream:
        raise not_supported("Streamed transcriptions", "stream")
    processor = served.audio_processor
    if processor is None:
        raise OpenAIError(
            f"The model `{request.model}` takes no audio: it cannot transcribe.",
            param="model",
            code="unsupported_content_type",
        )
    waveform, rate = decode_audio(request.file, "file", processor.limits)
    clip = process_audio(processor, waveform, rate, "file")
    instruction = INSTRUCTION
    if request.language:
        instruction += LANGUAGE.format(language=request.language)
    if request.prompt:
        instruction += CONTEXT.format(prompt=request.prompt)
    content = [{"type": "audio"}, {"type": "text", "text": instruction}]
    try:
        text = served.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
        )
    except (TemplateError, ValueError) as e:  # no template, or one that takes no audio part
        raise OpenAIError(
            f"The model's chat template cannot write a transcription request: {e}", param="model"
        ) from None
    prompt, items = place_media(
        served.tokenizer.encode(text, add_special_tokens=False), [clip], served
    )
    max_tokens = min(clip.num_tokens, served.max_model_len - len(prompt))
    check_context_length(len(prompt), max(max_tokens, 1), served, param="file")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    return PreparedTranscription(
        request=request,
        inputs=[EngineInput(new_id("transcription-"), prompt, params, items)],
    )
