import json
import random
import sys

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedbatch.engine.detokenizer import IncrementalDetokenizer
from pagedbatch.engine.sampling_params import SamplingParams
from pagedbatch.engine.tokenizer import eos_token_ids, load_tokenizer

CORPUS = [
    "Hello world, this is a small corpus for a byte-level BPE.",
    "The quick brown fox jumps over the lazy dog.\n\nStop here.",
    "你好，世界！今天天气很好。我们一起去公园吧。",
    "Emoji: 🎉🚀👍🏽 and 🇫🇷 flags, café, naïve, Straße, Ωμέγα.",
    "def main():\n    return 42  # the answer\n",
]
TEXT = "Hello world! 你好世界 🎉🚀 café\n\nThe end."


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", extra_special_tokens=["<|im_end|>"]
    )


@pytest.fixture(scope="module")
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """Llama 2 style: SentencePiece-like BPE whose unknown characters fall back to byte tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.train_from_iterator(
        CORPUS * 20, trainers.BpeTrainer(vocab_size=500, special_tokens=specials)
    )
    vocab = trained.get_vocab()
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = [tuple(merge) for merge in json.loads(trained.to_str())["model"]["merges"]]
    bpe = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    bpe.add_special_tokens(specials)
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def byte_tokens(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """One token per byte, so every multi-byte character is split across tokens."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(text))
    return tokenizer.convert_tokens_to_ids([char for piece in pieces for char in piece])


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int] | None = None
) -> list[str]:
    """Feed `ids` in chunks and return what a streaming caller would send at each step."""
    sizes = chunk_sizes or [1] * len(ids)
    sent, chunks, pos = "", [], 0
    for size in sizes:
        if detok.finished:
            break
        pos += size
        detok.update(ids[pos - size : pos], final=pos >= len(ids))
        text = detok.stable_text
        assert text.startswith(sent), "stable text must only grow"
        chunks.append(text[len(sent) :])
        sent = text
    return chunks


def random_chunks(rng: random.Random, n: int) -> list[int]:
    sizes = []
    while n > 0:
        sizes.append(min(n, rng.randint(1, 4)))
        n -= sizes[-1]
    return sizes


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("kind", ["tokenizer", "byte_fallback_tokenizer"])
def test_random_token_streams_equal_the_full_decode(request, kind, skip_special_tokens):
    tokenizer = request.getfixturevalue(kind)
    rng = random.Random(0)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for _ in range(500):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, params)
        chunks = stream(detok, ids, random_chunks(rng, len(ids)))
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(chunks) == expected
        assert detok.output_text == expected


def test_characters_split_across_tokens_never_emit_a_replacement_character(tokenizer):
    ids = byte_tokens(tokenizer, TEXT)
    assert len(ids) == len(TEXT.encode())
    chunks = stream(IncrementalDetokenizer(tokenizer, SamplingParams()), ids)
    assert "".join(chunks) == TEXT
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_byte_fallback_characters_are_emitted_whole(byte_fallback_tokenizer):
    tokenizer = byte_fallback_tokenizer
    ids = tokenizer.encode("Hello 😀 world", add_special_tokens=False)
    assert "<0xF0>" in tokenizer.convert_ids_to_tokens(ids)
    chunks = stream(IncrementalDetokenizer(tokenizer, SamplingParams()), ids)
    assert "".join(chunks) == "Hello 😀 world"
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_a_character_is_emitted_once_its_last_byte_arrives(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    emoji = byte_tokens(tokenizer, "🎉")
    for token in emoji[:-1]:
        detok.update([token])
        assert detok.stable_text == ""
    detok.update(emoji[-1:])
    assert detok.stable_text == "🎉"


def test_an_incomplete_character_at_the_end_decodes_as_the_tokenizer_does(tokenizer):
    ids = byte_tokens(tokenizer, "ok🎉")[:-2]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    chunks = stream(detok, ids)
    assert "".join(chunks) == tokenizer.decode(ids) == "ok\ufffd"


def test_mixed_text_with_special_tokens(tokenizer):
    ids = tokenizer.encode("你好<|im_end|>🎉 hi<|endoftext|>")
    for skip, expected in [(True, "你好🎉 hi"), (False, "你好<|im_end|>🎉 hi<|endoftext|>")]:
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
        assert "".join(stream(detok, ids)) == expected


def test_tokenizers_without_a_rust_backend_decode_the_same(tokenizer):
    class DecodeOnly:
        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    rng = random.Random(1)
    for _ in range(50):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(DecodeOnly(), SamplingParams())
        assert "".join(stream(detok, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_stop_string_across_token_boundaries_ends_the_text_before_it(tokenizer):
    ids = tokenizer.encode(TEXT)
    stop = "世界 🎉"
    assert not any(stop in tokenizer.decode([token]) for token in ids)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stop))
    chunks = stream(detok, ids)
    assert detok.finished
    assert detok.stop_string == stop
    assert detok.output_text == "".join(chunks) == "Hello world! 你好"


def test_a_stop_string_split_inside_a_character_is_found(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop="🚀"))
    chunks = stream(detok, byte_tokens(tokenizer, TEXT))
    assert "".join(chunks) == "Hello world! 你好世界 🎉"
    assert detok.stop_string == "🚀"


def test_include_stop_str_in_output_keeps_the_stop_string(tokenizer):
    params = SamplingParams(stop=["\n\n"], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer(tokenizer, params)
    chunks = stream(detok, tokenizer.encode(TEXT))
    assert "".join(chunks) == detok.output_text == "Hello world! 你好世界 🎉🚀 café\n\n"


def test_a_possible_stop_prefix_is_held_back_until_it_resolves(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["\n\nThe end"]))
    detok.update(tokenizer.encode("café\n"))
    assert detok.output_text == "café\n"
    assert detok.stable_text == "café"
    detok.update(tokenizer.encode("\nThe"))
    assert detok.stable_text == "café"
    detok.update(tokenizer.encode("ory"))
    assert detok.stable_text == "café\n\nTheory"
    assert not detok.finished


def test_text_that_cannot_start_a_stop_string_is_not_held(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["###"]))
    detok.update(tokenizer.encode("Hello world"))
    assert detok.stable_text == "Hello world"


def test_held_back_text_is_released_by_the_final_update(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["\n\n"]))
    detok.update(tokenizer.encode("The end.\n"))
    assert detok.stable_text == "The end."
    detok.update([], final=True)
    assert detok.finished
    assert detok.stop_string is None
    assert detok.stable_text == "The end.\n"


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["world", "lo"]))
    detok.update(tokenizer.encode("Hello world"))
    assert (detok.stop_string, detok.output_text) == ("lo", "Hel")


def test_the_first_stop_string_to_complete_wins_even_inside_a_longer_one(tokenizer):
    # Streamed a character at a time, "ic" completes before "quick"; a token must not change that.
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["quick", "ic"]))
    detok.update(tokenizer.encode("The quick fox"))
    assert (detok.stop_string, detok.output_text) == ("ic", "The qu")


def test_of_two_stop_strings_ending_together_the_longer_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["ck", "quick"]))
    detok.update(tokenizer.encode("The quick fox"))
    assert (detok.stop_string, detok.output_text) == ("quick", "The ")


def test_stop_strings_completed_before_min_tokens_do_not_count(tokenizer):
    ids = tokenizer.encode("a! b! c")
    bang = [i for i, token in enumerate(ids) if "!" in tokenizer.decode([token])]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["!"], min_tokens=bang[0] + 2))
    assert [detok.update([token]) for token in ids[: bang[0] + 1]] == [None] * (bang[0] + 1)
    assert not detok.finished
    for token in ids[bang[0] + 1 :]:
        if detok.update([token]):
            break
    assert (detok.stop_string, detok.output_text) == ("!", "a! b")


def test_no_tokens_are_taken_after_a_stop_string(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["!"]))
    assert detok.update(tokenizer.encode("Hi! there")) == "!"
    assert detok.stable_text == "Hi"
    with pytest.raises(RuntimeError):
        detok.update(tokenizer.encode("more"))


def test_random_streams_with_stop_strings_match_the_cut_full_decode(tokenizer):
    rng = random.Random(2)
    stops = ["界 ", "\n\n", "e e", "🚀"]
    for _ in range(200):
        ids = tokenizer.encode("".join(rng.choice(CORPUS + [TEXT]) for _ in range(2)))
        ids = ids[rng.randrange(len(ids)) :]
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stops))
        chunks = stream(detok, ids, random_chunks(rng, len(ids)))
        full = tokenizer.decode(ids)
        found = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
        expected = full[: min(found)[1]] if found else full
        assert "".join(chunks) == detok.output_text == expected


def test_a_saved_tokenizer_loads_and_decodes_the_same(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    ids = tokenizer.encode(TEXT + "<|im_end|>")
    assert loaded.encode(TEXT + "<|im_end|>") == ids
    detok = IncrementalDetokenizer(loaded, SamplingParams(skip_special_tokens=False))
    assert "".join(stream(detok, ids)) == TEXT + "<|im_end|>"


def test_eos_ids_join_the_generation_config_and_the_tokenizer(tokenizer, tmp_path):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(tmp_path, tokenizer) == {7, tokenizer.eos_token_id}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, 5]}))
    assert eos_token_ids(tmp_path, tokenizer) == {im_end, 5, tokenizer.eos_token_id}


def held_back(text: str, stops: list[str]) -> int:
    """The longest tail of `text` that is a proper prefix of a stop string, found the slow way."""
    return max(
        (n for stop in stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0
    )


def test_hold_back_and_stops_on_self_overlapping_stop_strings(tokenizer):
    # Stop strings that overlap themselves and each other, over a text of their own letters: a
    # failed partial match must fall back to the longest prefix that still fits.
    rng = random.Random(3)
    stops = ["aabaab", "abaabb", "bbbba", "aaaaab"]
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text)
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stops))
        for token in ids:
            if detok.update([token]):
                break
            assert (
                detok.stable_text
                == detok.output_text[: len(detok.output_text) - held_back(detok.output_text, stops)]
            )
        found = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        assert detok.output_text == (text[: min(found)[1]] if found else text)
        assert detok.stop_string == (text[min(found)[1] : min(found)[0]] if found else None)


def lines_run(detok: IncrementalDetokenizer, ids: list[int]) -> list[int]:
    """How many lines of the detokenizer's module each one-token update runs."""
    counts = []
    module = IncrementalDetokenizer.__init__.__code__.co_filename

    def trace(frame, event, _arg):
        if frame.f_code.co_filename != module:
            return None
        if event == "line":
            counts[-1] += 1
        return trace

    sys.settrace(trace)
    try:
        for token in ids:
            counts.append(0)
            detok.update([token])
    finally:
        sys.settrace(None)
    return counts


def test_an_update_costs_the_same_however_long_the_text_and_the_stop_strings(tokenizer):
    # Counted in lines run, not timed: the work of an update must not grow with the text that came
    # before it, nor with the length of the stop strings it is matched against.
    rng = random.Random(4)
    ids = tokenizer.encode("".join(rng.choice(["ab", "ba", "xa", "b x"]) for _ in range(600)))
    short = lines_run(IncrementalDetokenizer(tokenizer, SamplingParams(stop="abc")), ids)
    long = lines_run(IncrementalDetokenizer(tokenizer, SamplingParams(stop="ab" * 127 + "c")), ids)
    assert sum(long) < 1.5 * sum(short)
    tenth = len(ids) // 10
    assert sum(long[-tenth:]) < 1.5 * sum(long[:tenth])
