"""Character-level tokenizers in the Hugging Face format, with the R1-Distill chat markers."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from magic_jax.data.rows import R1_ASSISTANT, R1_BOS, R1_EOS, R1_USER

R1_SPECIALS = ("<pad>", R1_BOS, R1_EOS, R1_USER, R1_ASSISTANT)
R1_THINK = ("<think>", "</think>")


def char_tokenizer(
    chars: str,
    specials: tuple[str, ...] = R1_SPECIALS,
    added: tuple[str, ...] = R1_THINK,
):
    """A character-level Hugging Face fast tokenizer (one token per character).

    ``specials`` (pad, BOS, EOS and the R1-Distill chat markers by default, ids
    0, 1, 2, ...) are special tokens, dropped by ``decode(...,
    skip_special_tokens=True)``; ``added`` (``<think>``, ``</think>``) are whole
    tokens that decoding keeps, as in the R1-Distill tokenizer. Every other
    character maps to ``<unk>`` (the last id). ``save_pretrained`` writes it
    next to a checkpoint, and ``AutoTokenizer.from_pretrained`` reads it back.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = [*specials, *added, *dict.fromkeys(chars), "<unk>"]
    vocab = {t: i for i, t in enumerate(names)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    tok.add_tokens(list(added))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token=specials[0],
        bos_token=specials[1] if len(specials) > 1 else None,
        eos_token=specials[2] if len(specials) > 2 else None,
    )


class TokenPieces:
    """The text of each token id alone (``decode([id])``), each id decoded once: what a
    token classifier (``magic_jax.data.tasks.carry.token_classes``) reads.

    Args:
      decode: ids -> text (a tokenizer's ``decode``).
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._pieces: dict[int, str] = {}

    def __call__(self, ids: Iterable[int]) -> list[str]:
        out = []
        for i in (int(x) for x in ids):
            if i not in self._pieces:
                self._pieces[i] = self._decode([i])
            out.append(self._pieces[i])
        return out
