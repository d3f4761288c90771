"""Incremental detokenisation against a full decode, with real tokenizers trained locally, and
stop-string matching."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagellm.core.detokenizer import IncrementalDetokenizer, check_stop_strings

CORPUS = [
    "Hello world, this is a small test of the tokenizer.",
    "你好，世界！这是一个测试。我们喜欢中文和日本語のテキスト。",
    "Emoji 😀🎉 are fun 👍🏽 and flags 🇫🇷 too; café naïve Ünïcödé.",
    "The quick brown fox jumps over the lazy dog 123 times.",
] * 5
SPECIALS = ["<s>", "</s>"]


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """GPT-2 style: byte-level BPE, so any id sequence is decodable, even invalid UTF-8."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(["<extra>", "中文词"])  # added, non-special tokens bypass the byte decoder
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def sentencepiece_style() -> PreTrainedTokenizerFast:
    """Llama style: "▁" for spaces, <0xXX> byte fallback, and a decoder that strips the
    leading space of the text, so a token's text depends on what precedes it."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS],
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz▁"))
    tok.train_from_iterator([s for s in CORPUS if s.isascii()], trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    first = max(vocab.values()) + 1
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = first + b
    spec["model"]["byte_fallback"] = True
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)


def pieces(tokenizer, prompt: list[int], generated: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    return [detok.add_token(t) for t in generated] + [detok.flush()]


# ---- byte-level ----------------------------------------------------------------------------

@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_concatenate_to_the_full_decode(byte_level, skip_special_tokens) -> None:
    rng = random.Random(0)
    vocab = len(byte_level)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        got = pieces(byte_level, [], ids, skip_special_tokens=skip_special_tokens)
        assert "".join(got) == byte_level.decode(ids, skip_special_tokens=skip_special_tokens)


def test_random_ids_after_a_prompt(byte_level) -> None:
    rng = random.Random(1)
    vocab = len(byte_level)
    for _ in range(300):
        prompt = byte_level.encode(rng.choice(CORPUS)[: rng.randrange(1, 30)])
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prompt_text = byte_level.decode(prompt, skip_special_tokens=True)
        if prompt_text.endswith("\ufffd"):
            continue  # the prompt ends mid-character: its text changes with the output
        full = byte_level.decode(prompt + ids, skip_special_tokens=True)
        assert full.startswith(prompt_text)
        assert "".join(pieces(byte_level, prompt, ids)) == full[len(prompt_text):]


def test_multi_byte_characters_are_held_back_until_complete(byte_level) -> None:
    # One token per byte, as a model may produce them.
    table = bytes_to_unicode()
    ids = [byte_level.convert_tokens_to_ids(table[byte]) for byte in "a😀中".encode()]
    got = pieces(byte_level, [], ids)
    assert got == ["a", "", "", "", "😀", "", "", "中", ""]
    assert not any("\ufffd" in piece for piece in got)


def test_a_sequence_ending_mid_character_is_flushed(byte_level) -> None:
    ids = byte_level.encode("ok 😀")
    detok = IncrementalDetokenizer(byte_level)
    emoji_bytes = [byte_level.convert_tokens_to_ids(bytes_to_unicode()[b]) for b in "😀".encode()]
    text = detok.add_tokens(ids) + detok.add_tokens(emoji_bytes[:2])
    assert text == "ok 😀"
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""


def test_special_tokens(byte_level) -> None:
    ids = byte_level.encode("Hello") + [byte_level.eos_token_id] + byte_level.encode(" 你好")
    assert "".join(pieces(byte_level, [], ids)) == "Hello 你好"
    assert "".join(pieces(byte_level, [], ids, skip_special_tokens=False)) == "Hello</s> 你好"


# ---- SentencePiece style -------------------------------------------------------------------

def test_leading_spaces_depend_on_the_context(sentencepiece_style) -> None:
    tok = sentencepiece_style
    prompt = tok.encode("hello")
    generated = tok.encode("world is big")
    assert tok.decode(generated).startswith("world")  # the decoder strips one leading space
    text = "".join(pieces(tok, prompt, generated))
    assert text == " world is big"
    assert "".join(pieces(tok, [], generated)) == "world is big"


def test_valid_sequences_concatenate_to_the_full_decode(sentencepiece_style) -> None:
    tok = sentencepiece_style
    rng = random.Random(2)
    words = " ".join(CORPUS).split()
    checked = 0
    for _ in range(200):
        text = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 8)))
        ids = tok.encode(text)
        if rng.random() < 0.5:
            ids.insert(rng.randrange(len(ids) + 1), tok.eos_token_id)
        split = rng.randrange(len(ids))
        prompt, generated = ids[:split], ids[split:]
        prompt_text = tok.decode(prompt, skip_special_tokens=True)
        if prompt_text.endswith("\ufffd"):
            continue  # the prompt ends mid-character: its text changes with the output
        full = tok.decode(ids, skip_special_tokens=True)
        assert full.startswith(prompt_text)
        assert "".join(pieces(tok, prompt, generated)) == full[len(prompt_text):], text
        checked += 1
    assert checked > 100
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(tok.encode("中😀")))


# ---- stop strings --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "new", "stop", "include", "expected"),
    [
        ("Hello world", 5, ["world"], False, ("Hello ", "world")),
        ("Hello world", 5, ["world"], True, ("Hello world", "world")),
        ("Hello world", 1, ["world"], False, ("Hello ", "world")),  # spans old and new text
        ("Hello world!", 1, ["world"], False, None),  # ended before the new text: seen already
        ("Hello world", 0, ["world"], False, None),
        ("Hello world", 5, [], False, None),
        ("abcSTOPdefSTOP", 7, ["STOP"], False, ("abcSTOPdef", "STOP")),
        ("one. two\n\nthree", 12, ["\n\n", "."], False, ("one", ".")),  # earliest wins
        ("one. two\n\nthree", 12, [".", "\n\n"], True, ("one.", ".")),
        ("xxabcd", 4, ["abcd", "ab"], False, ("xx", "abcd")),  # same start: first listed
        ("xxabcd", 4, ["abcd", "ab"], True, ("xxabcd", "abcd")),
        ("你好世界", 2, ["世界"], False, ("你好", "世界")),
        ("short", 5, ["a much longer stop string"], False, None),
    ],
)
def test_check_stop_strings(text, new, stop, include, expected) -> None:
    assert check_stop_strings(text, new, stop, include) == expected


def test_stop_strings_while_streaming(byte_level) -> None:
    """Feed text token by token: the stop string is found exactly when it completes."""
    ids = byte_level.encode("Hello world, this is a test.")
    detok = IncrementalDetokenizer(byte_level)
    text = ""
    for token in ids:
        new = detok.add_token(token)
        text += new
        hit = check_stop_strings(text, len(new), ["is a", "zzz"], False)
        if hit:
            assert hit == ("Hello world, this ", "is a")
            assert text.endswith("is a") or text.endswith("is a ")
            return
    pytest.fail("stop string not found")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, as the ByteLevel pre-tokenizer uses it."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def test_decode_cost_does_not_grow_with_the_sequence(byte_level) -> None:
    """Each step decodes a short window, not the whole sequence."""
    class RecordingBackend:
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
            self.lengths.append(len(ids))
            return byte_level.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    class Wrapped:
        backend_tokenizer = RecordingBackend()

    ids = byte_level.encode(" ".join(CORPUS * 3))
    assert len(ids) > 500
    detok = IncrementalDetokenizer(Wrapped(), ids[:50])
    text = detok.add_tokens(ids[50:]) + detok.flush()
    assert text == byte_level.decode(ids)[len(byte_level.decode(ids[:50])):]
    assert max(Wrapped.backend_tokenizer.lengths) <= 12
