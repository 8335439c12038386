"""The byte-level BPE tokenizer that every generated checkpoint ships.

It is trained on a corpus generated procedurally from a fixed seed, so building it downloads
nothing and gives the same tokenizer.json, byte for byte, on every machine. Being byte-level, it
has no unknown token and round-trips any UTF-8 text exactly (emoji, CJK, control characters),
except that Qwen2 checkpoints normalise text to NFC first, as transformers insists for Qwen2.

Special tokens come last in the vocabulary, as in Qwen and Llama 3. Encoding adds no BOS token:
prompts are exactly the ids of their text, which keeps prefix-caching and chat-template tests
simple.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# The whole vocabulary, special tokens included: a model built on it needs no padded rows, so
# every id it can emit decodes to text.
VOCAB_SIZE = 16384
# Added after training, so they take the last ids.
SPECIAL_TOKEN_IDS = {t: VOCAB_SIZE - len(SPECIAL_TOKENS) + i for i, t in enumerate(SPECIAL_TOKENS)}

# ChatML, with tools and tool calls laid out as Qwen2.5 does. Content may be a string or a list of
# {"type": "text", "text": ...}, {"type": "image"} and {"type": "audio"} parts, the media where
# `chat_template` says;
# the system turn lists the tools, if any, as JSON.
_CHAT_TEMPLATE = r"""
{%- macro text(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part.type == "text" -%}
                {{- part.text -}}
            {%- elif part.type == "image" -%}
                {{- IMAGE_PLACEHOLDER -}}
            {%- elif part.type == "audio" -%}
                {{- AUDIO_PLACEHOLDER -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == "system" -%}
{%- if has_system or tools -%}
    {{- "<|im_start|>system\n" -}}
    {%- if has_system -%}
        {{- text(messages[0].content) -}}
        {%- if tools -%}
            {{- "\n\n" -}}
        {%- endif -%}
    {%- endif -%}
    {%- if tools -%}
        {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" -}}
        {{- "You are provided with function signatures within <tools></tools> XML tags:\n" -}}
        {{- "<tools>" -}}
        {%- for tool in tools -%}
            {{- "\n" + (tool | tojson) -}}
        {%- endfor -%}
        {{- "\n</tools>\n\nFor each function call, return a json object with function name and " -}}
        {{- "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" -}}
        {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
    {%- endif -%}
    {{- "<|im_end|>\n" -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == "system" and loop.first -%}
    {%- elif message.role == "tool" -%}
        {%- if loop.first or loop.previtem.role != "tool" -%}
            {{- "<|im_start|>user" -}}
        {%- endif -%}
        {{- "\n<tool_response>\n" + text(message.content) + "\n</tool_response>" -}}
        {%- if loop.last or loop.nextitem.role != "tool" -%}
            {{- "<|im_end|>\n" -}}
        {%- endif -%}
    {%- else -%}
        {%- set content = text(message.content) -%}
        {{- "<|im_start|>" + message.role + "\n" + content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set function = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- "\n" -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": ' + (function.name | tojson) + ', "arguments": ' -}}
            {%- if function.arguments is string -%}
                {{- function.arguments -}}
            {%- else -%}
                {{- function.arguments | tojson -}}
            {%- endif -%}
            {{- "}\n</tool_call>" -}}
        {%- endfor -%}
        {{- "<|im_end|>\n" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|im_start|>assistant\n" -}}
{%- endif -%}
""".strip()


def chat_template(image_placeholder: str = "", audio_placeholder: str = "") -> str:
    """The chat template, writing `image_placeholder` for each image part and
    `audio_placeholder` for each audio part (nothing by default: a text-only model's template
    leaves them out)."""
    return _CHAT_TEMPLATE.replace("IMAGE_PLACEHOLDER", json.dumps(image_placeholder)).replace(
        "AUDIO_PLACEHOLDER", json.dumps(audio_placeholder)
    )


CHAT_TEMPLATE = chat_template()

# Qwen2's pre-tokenizer split (digits one by one, words with their leading space or punctuation).
# transformers 5 rebuilds a qwen2 checkpoint's tokenizer with it and NFC, whatever tokenizer.json
# says; using it for every checkpoint keeps tokenization the same across architectures and tools.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED = 20240517
_NUM_LINES = 12_000

_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by not word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city tree cross farm hard start might story saw
far sea draw left late run don't while press close night real life few north open seem together
next white children begin got walk example ease paper group always music those both mark often
letter until mile river car feet care second book carry took science eat room friend began idea
fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct leave song
measure door product black short class wind question happen complete ship area half rock order
fire south problem piece told knew pass since top whole king space heard best hour better true
during hundred five remember step early hold west ground interest reach fast sing listen six table
travel less morning ten simple several toward war lay against pattern slow center love person
money serve appear road map rain rule pull cold notice voice unit power town fine certain fly fall
lead cry dark machine note wait plan figure star box field rest correct able pound done beauty
drive stood contain front teach week final gave green quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch nothing course stay wheel full force blue
object decide surface deep moon island foot system busy test record boat common gold possible
plane dry wonder laugh thousand ago ran check game shape hot miss brought heat snow bring yes
distant fill east paint language among weather tomorrow today please thanks hello answer city
"""

_CODE_WORDS = """
def return class import from None True False null true false self function const let var if else
elif for while in async await print len range str int float dict list json value key name id type
text content role user assistant system tool tools arguments result error status data items count
index total message messages model request response input output config path file line args kwargs
"""

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr kr pl pr sh sk sl sp st str th tr"
_VOWELS = "a e i o u ai ea ee io ou oo y"
_CODAS = "n r s t l m nd ng st ck rt x"


def _pseudo_words(rng: random.Random, count: int) -> list[str]:
    """Pronounceable nonsense words, so BPE has many merges to learn beyond the real words."""
    onsets = ["", *_ONSETS.split()]
    vowels = _VOWELS.split()
    codas = ["", "", *_CODAS.split()]
    words: dict[str, None] = {}  # an ordered set: iteration order must not depend on hashing
    while len(words) < count:
        syllables = rng.randint(1, 4)
        word = "".join(
            rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables)
        )
        words[word] = None
    return list(words)


def _corpus(rng: random.Random) -> Iterator[str]:
    lexicon = _COMMON_WORDS.split() + _CODE_WORDS.split() + _pseudo_words(rng, 30_000)
    # Zipf-distributed ranks, like natural text: frequent words become single tokens.
    cum_weights = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(lexicon))))

    def words(k: int) -> list[str]:
        return rng.choices(lexicon, cum_weights=cum_weights, k=k)

    def sentence() -> str:
        sentence_words = words(rng.randint(4, 20))
        sentence_words[0] = sentence_words[0].capitalize()
        return " ".join(sentence_words) + rng.choice([".", ".", "?", "!", ",", ":"])

    for _ in range(_NUM_LINES):
        kind = rng.random()
        if kind < 0.55:
            yield " ".join(sentence() for _ in range(rng.randint(1, 3)))
        elif kind < 0.75:
            a, b, c = words(3)
            yield json.dumps(
                {a: b, "id": rng.randint(0, 9999), c: [rng.random() < 0.5, None, rng.random()]}
            )
        elif kind < 0.9:
            f, x, y = words(3)
            op = rng.choice(["+", "-", "*", "/", "==", ">=", "<="])
            yield f"def {f}({x}, {y}):\n    return {x} {op} {y}  # {rng.randint(0, 99)}\n"
        else:
            yield (
                f"{rng.randint(1900, 2100)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} "
                f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} ${rng.randint(0, 10**6):,}"
            )


@functools.lru_cache(maxsize=1)
def _trained_tokenizer_json() -> str:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(random.Random(_SEED)), trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"the corpus yields {tokenizer.get_vocab_size()} tokens, not {VOCAB_SIZE}"
        )
    return tokenizer.to_str()


def tokenizer_json(nfc: bool = False) -> str:
    """The tokenizer.json text, trained once per process (about a second).

    `nfc` adds an NFC normalizer, which transformers imposes on Qwen2 tokenizers anyway.
    """
    trained = _trained_tokenizer_json()
    if not nfc:
        return trained
    tokenizer = Tokenizer.from_str(trained)
    tokenizer.normalizer = normalizers.NFC()
    return tokenizer.to_str()


def write_tokenizer(
    out_dir: Path, nfc: bool = False, extra_special: tuple[str, ...] = (), template: str = ""
) -> None:
    """Write tokenizer.json and tokenizer_config.json, as transformers' AutoTokenizer reads them.

    `extra_special` tokens (a multimodal model's placeholders) take the ids from VOCAB_SIZE on;
    `template` is the chat template (default: the text-only one)."""
    text = tokenizer_json(nfc)
    if extra_special:
        tokenizer = Tokenizer.from_str(text)
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t in extra_special]
        )
        text = tokenizer.to_str()
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END, *extra_special],
        "add_bos_token": False,
        "add_eos_token": False,
        # The default would rewrite " ." as "." on decode and break the exact round trip.
        "clean_up_tokenization_spaces": False,
        "chat_template": template or CHAT_TEMPLATE,
    }
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")
