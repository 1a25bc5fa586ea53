"""Stand-ins the tool tests share: a chat tokenizer and a small GSM8K file."""
import json


class FakeTokenizer:
    """A template that writes "<s>" itself; ``adds_bos``: the tokenizer also adds it (id 1) with special tokens."""

    bos_token, bos_token_id = "<s>", 1

    def __init__(self, adds_bos: bool = False):
        self.adds_bos = adds_bos

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize and len(messages) == 1 and messages[0]["role"] == "user"
        return "<s>user: " + messages[0]["content"] + "\nassistant: "

    def encode(self, text, add_special_tokens=True):
        ids = [1] if self.adds_bos and add_special_tokens else []
        if text.startswith("<s>"):
            ids, text = ids + [1], text[len("<s>"):]
        return ids + [ord(c) for c in text]


def write_gsm8k(path, n: int, first_gold: int = 0) -> str:
    """``n`` records ``q{i}?`` whose gold is ``first_gold + i``; the path as a string."""
    path.write_text("".join(json.dumps({"question": f"q{i}?", "answer": f"... #### {first_gold + i}"}) + "\n"
                            for i in range(n)))
    return str(path)
