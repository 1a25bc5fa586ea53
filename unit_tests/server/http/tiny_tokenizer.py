"""A byte-level BPE tokenizer that fits a tiny checkpoint's vocabulary, so the real server can run
over ``unit_tests/models/tiny_checkpoints`` models (which have none): 256 byte tokens, merges of
common letter pairs, and the two chat tokens of a ChatML template, ``vocab_size`` tokens in all."""
import itertools
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def bytes_to_unicode():
    """GPT-2's byte -> printable character map (what ByteLevel pre-tokenization writes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), 256))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, (chr(c) for c in cs)))

CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(model_dir: str, vocab_size: int) -> None:
    """Save the tokenizer into ``model_dir`` (beside the checkpoint); eos is <|im_end|>."""
    byte_chars = list(bytes_to_unicode().values())  # 256
    vocab = {c: i for i, c in enumerate(byte_chars)}
    merges = []
    letters = "etaoinsrhl "
    byte_of = bytes_to_unicode()
    for a, b in itertools.product(letters, letters):
        if len(vocab) >= vocab_size - len(CHAT_TOKENS):
            break
        left, right = byte_of[ord(a)], byte_of[ord(b)]
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=CHAT_TOKENS[1], chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(model_dir)
    assert os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
