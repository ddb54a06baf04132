"""The bound on characters per token (``colibri_core.model.token_bounds``): where it is
given it holds for any text (a text is never refused that would fit the context), and
where a step of the tokenizer drops text there is none. Also: tokenizing lets other
threads run (a server's event loop among them)."""

import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from colibri_core.model.token_bounds import COMPOSITION, max_chars_per_token

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Ünïcödé façade naïve café — 東京 北京 😀🎉",
          "    indented   code = [1, 2, 3]  # comment\n\t\ttabs", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa bbbbbbbbbbbbbbbbbbbb"] * 20


def byte_level_bpe(**added) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    if added:
        tok.add_special_tokens([AddedToken("<|im_start|>", **added)])
    return tok


def sentencepiece_bpe(normalizer=None, byte_fallback=True, unk=None, fuse_unk=False) -> Tokenizer:
    """Llama-style: spaces as "▁", unknown characters as byte tokens (or an unknown token)."""
    tok = Tokenizer(models.BPE(byte_fallback=byte_fallback, unk_token=unk, fuse_unk=fuse_unk))
    tok.normalizer = normalizer or normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    special = ["<unk>"] + ([f"<0x{b:02X}>" for b in range(256)] if byte_fallback else [])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=special, show_progress=False))
    return tok


def bound(tok: Tokenizer):
    return max_chars_per_token(json.loads(tok.to_str()))


def longest(tok: Tokenizer) -> int:
    return max(len(t) for t in tok.get_vocab(with_added_tokens=True))


def test_byte_level_bpe_is_bounded_by_its_longest_token():
    tok = byte_level_bpe()
    assert bound(tok) == longest(tok)


def test_composition_and_replacement_widen_the_bound():
    composed = sentencepiece_bpe(normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("  ", "▁")]))
    assert bound(composed) == COMPOSITION * 2 * longest(composed)
    assert bound(sentencepiece_bpe()) == longest(sentencepiece_bpe())
    assert bound(sentencepiece_bpe(byte_fallback=False, unk="<unk>")) == longest(sentencepiece_bpe(byte_fallback=False, unk="<unk>"))


def test_composition_never_joins_more_than_four_characters():
    import sys
    import unicodedata

    assert max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
               if not 0xD800 <= c <= 0xDFFF) == COMPOSITION


@pytest.mark.parametrize("make", [
    lambda: byte_level_bpe(lstrip=True),  # an added token that swallows the spaces before it
    lambda: sentencepiece_bpe(normalizers.Sequence([normalizers.Strip(), normalizers.Replace(" ", "▁")])),
    lambda: sentencepiece_bpe(normalizers.Replace(Regex(" +"), "▁")),  # a run of spaces becomes one
    lambda: sentencepiece_bpe(normalizers.Sequence([normalizers.NFD(), normalizers.StripAccents()])),
    lambda: sentencepiece_bpe(byte_fallback=False, unk="<unk>", fuse_unk=True),  # unknown runs fused into one token
    lambda: sentencepiece_bpe(byte_fallback=False),  # unknown characters dropped
], ids=["lstrip", "strip", "regex", "strip_accents", "fuse_unk", "dropped"])
def test_no_bound_where_text_may_be_dropped(make):
    assert bound(make()) is None


def test_no_bound_for_whitespace_splitting_wordpiece_or_truncation():
    tok = byte_level_bpe()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    assert bound(tok) is None
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    assert bound(wordpiece) is None
    truncated = byte_level_bpe()
    truncated.enable_truncation(16)
    assert bound(truncated) is None


TEXT = st.text(st.characters(codec="utf-8"), max_size=400) | st.lists(
    st.sampled_from(["a" * 32, "b" * 20, " ", "    ", "\t", "<|endoftext|>", "<|im_start|>", "ệ", "e\u0323\u0302",
                     "\u1100\u1161\u11a8", "😀", "東", "\x00", "▁", "café"]), max_size=200).map("".join)


@pytest.mark.parametrize("make", [byte_level_bpe, lambda: byte_level_bpe(lstrip=False), sentencepiece_bpe,
                                  lambda: sentencepiece_bpe(normalizers.Sequence([
                                      normalizers.NFKC(), normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]))],
                         ids=["byte_level", "added_token", "byte_fallback", "nfkc"])
def test_no_text_has_more_characters_than_the_bound_allows_its_tokens(make):
    tok = make()
    per_token = bound(tok)
    assert per_token is not None

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(TEXT)
    def holds(text):
        assert len(text) <= per_token * len(tok.encode(text, add_special_tokens=False).ids)

    holds()


def test_tokenizing_lets_other_threads_run(tmp_path):
    from colibri_core.model.tokenizer import Tokenizer as ColibriTokenizer

    byte_level_bpe().save(str(tmp_path / "tokenizer.json"))
    tok = ColibriTokenizer(tmp_path)
    text = "the quick brown fox jumps over the lazy dog " * 40_000  # ~1.7 MB: about a second to tokenize
    ticks = []
    worker = threading.Thread(target=tok.encode, args=(text,))
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
        time.sleep(0.005)
    worker.join()
    # holding the GIL, the tokenizer would let this thread run only at its end (before: 2 ticks)
    assert len(ticks) >= 20, len(ticks)
