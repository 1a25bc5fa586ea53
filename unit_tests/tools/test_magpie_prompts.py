"""Magpie prompts (lightllm/tools/magpie_prompts.py): the template's user-turn prefix on a
hand-written template and on the embedded tokenizer, the cleaning filter on hand-made turns,
the round loop and its split over domains with a scripted engine, seeded sampling through the
real engine on a tiny random Llama (CPU), prompt mixing and files, and the held-out set."""
import dataclasses
import json
import os
from collections import Counter
from types import SimpleNamespace

import pytest

from lightllm.tools import magpie_prompts as mp
from lightllm.tools.magpie_prompts import (
    DEFAULT_HELDOUT_PATH,
    MAGPIE_DOMAINS,
    DROP_DUPLICATE,
    DROP_EMPTY,
    DROP_LONG,
    DROP_OVERLONG,
    DROP_SHORT,
    DROP_TAG,
    SEED_STRIDE,
    SENTINEL,
    DomainShare,
    FilterConfig,
    MagpieConfig,
    PromptRecord,
    RawTurn,
    as_records,
    collect_prompts,
    domain_counts,
    domain_deadlines,
    domain_prefixes,
    filter_user_turns,
    heldout_overlap,
    load_heldout,
    mix_counts,
    mix_prompts,
    normalize_prompt,
    parse_domains,
    read_prompt_set,
    request_seed,
    sample_user_turns,
    strip_end_of_turn,
    user_turn_prefix,
    write_prompt_set,
)

TINY_VOCAB_SIZE = 301  # the tiny Llama's (unit_tests/models/tiny_checkpoints.py)
TINY_SPECIALS = ["[UNK]", "<s>", "</s>", "<turn>", "<end>"]
TINY_WORDS = ["system", "user", "assistant", "Default", "Be", "brief.", "[INST]", "[/INST]"]
# ChatML-like, with its own tags and a default system turn (as SmolLM2's renders one)
TINY_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<turn>system\nDefault system.<end>\n{% endif %}"
    "{% for m in messages %}<turn>{{ m['role'] }}\n{{ m['content'] | trim }}<end>\n{% endfor %}"
    "{% if add_generation_prompt %}<turn>assistant\n{% endif %}"
)
# Llama-2-like: the user turn ends in plain text, not a special token
INST_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% endif %}"
                 "{% endfor %}")
HELDOUT_KIND_COUNTS = {"code": 40, "writing": 40, "advice": 40, "explanation": 40, "math": 20}
HELDOUT_SOURCE = "written for this repo, 2026-11-30"
DEFAULT_TINY_PREFIX = "<s><turn>system\nDefault system.<end>\n<turn>user\n"  # TINY_TEMPLATE's default system turn
VALID_DOMAINS_MESSAGE = "valid names: default, code, writing, advice, explanation"


def tiny_tokenizer(template: str = TINY_TEMPLATE):
    """A word-level tokenizer of the tiny Llama's vocabulary size with special tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = TINY_SPECIALS + TINY_WORDS
    words += [f"w{i}" for i in range(TINY_VOCAB_SIZE - len(words))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")
    tok.add_tokens(["<turn>", "<end>"], special_tokens=True)
    tok.chat_template = template
    return tok


def word_id(tok, word: str) -> int:
    [i] = tok.encode(word, add_special_tokens=False)
    return i


# ---- the user-turn prefix ----


def test_prefix_of_a_hand_written_template_keeps_its_default_system_turn():
    tok = tiny_tokenizer()
    p = user_turn_prefix(tok)
    assert p.text == "<s><turn>system\nDefault system.<end>\n<turn>user\n"
    assert p.end_of_turn == "<end>" and p.end_of_turn_ids == (word_id(tok, "<end>"),)
    assert p.tags == ("<turn>", "<end>", "[UNK]", "</s>", "<s>", "<turn>user")
    # a message continued from the prefix renders exactly as the template renders it
    rendered = tok.apply_chat_template([{"role": "user", "content": "w1 w2"}], tokenize=False)
    assert rendered == p.text + "w1 w2" + p.end_of_turn + "\n"


def test_prefix_with_a_system_prompt_replaces_the_default():
    p = user_turn_prefix(tiny_tokenizer(), system_prompt="Be brief.")
    assert p.text == "<s><turn>system\nBe brief.<end>\n<turn>user\n"


def test_prefix_of_a_template_that_ends_the_turn_in_plain_text():
    tok = tiny_tokenizer(INST_TEMPLATE)
    p = user_turn_prefix(tok)
    assert p.text == "[INST] "
    assert p.end_of_turn == "[/INST]" and p.end_of_turn_ids == (word_id(tok, "[/INST]"),)
    assert "[INST]" in p.tags and "[/INST]" in p.tags


def test_prefix_rejects_a_template_that_repeats_the_message():
    tok = tiny_tokenizer("{% for m in messages %}{{ m['content'] }} {{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="2 times"):
        user_turn_prefix(tok)


def test_sentinel_survives_trimming_and_escaping():
    assert SENTINEL.isalnum()


def test_prefix_of_the_embedded_model():
    from transformers import AutoTokenizer

    from lightllm.utils import embedded_model

    try:
        model_dir = embedded_model.get_default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(f"embedded model unavailable: {e}")
    tok = AutoTokenizer.from_pretrained(model_dir)
    p = user_turn_prefix(tok)
    assert p.text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\n")
    assert p.end_of_turn == "<|im_end|>" and p.end_of_turn_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user"} <= set(p.tags)
    assert user_turn_prefix(tok, "Be brief.").text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


# ---- cleaning ----

TAGS = ("<|im_start|>", "<|im_end|>", "<|im_start|>user")


def test_filter_drops_each_kind_of_bad_turn_and_keeps_order():
    turns = [
        RawTurn("  How do I boil an egg?  \n", True),
        RawTurn("How do I fold a paper plane so that it flies far", False),  # hit the limit: overlong
        RawTurn("   \n ", True),
        RawTurn("Hi", True),
        RawTurn("ok then go", True),  # 3 words but under min_chars
        RawTurn("What is this?<|im_end|><|im_start|>assistant", True),
        RawTurn("Tell me a joke <|endoftext|> please", True),  # generic <|...|> tag
        RawTurn("how do I BOIL an egg", True),  # normalised duplicate of the first
        RawTurn("x " * 20, True),
        RawTurn("Explain how rainbows form.", True),
    ]
    got = filter_user_turns(turns, TAGS, FilterConfig(min_chars=12, min_words=3, max_chars=30))
    assert got.kept == ["How do I boil an egg?", "Explain how rainbows form."]
    assert got.dropped == {DROP_OVERLONG: 1, DROP_EMPTY: 1, DROP_TAG: 2, DROP_SHORT: 2, DROP_LONG: 1,
                           DROP_DUPLICATE: 1}


def test_filter_counts_earlier_rounds_as_seen():
    got = filter_user_turns([RawTurn("Write a poem about rain.", True), RawTurn("Write a poem about snow.", True)],
                            TAGS, seen=[normalize_prompt("write a POEM about rain")])
    assert got.kept == ["Write a poem about snow."] and got.dropped[DROP_DUPLICATE] == 1


def test_normalize_prompt():
    assert normalize_prompt("  What's   the TIME?\n") == normalize_prompt("what s the time") == "what s the time"
    assert normalize_prompt("Ｆｕｌｌ-width_text") == "full width text"  # NFKC, underscores are separators


def test_filter_config_validates():
    with pytest.raises(ValueError):
        FilterConfig(min_chars=10, max_chars=5)


def test_strip_end_of_turn():
    assert strip_end_of_turn([5, 6, 2], (2,), [2]) == [5, 6]
    assert strip_end_of_turn([5, 6, 8, 9], (8, 9), [2]) == [5, 6]
    assert strip_end_of_turn([5, 6, 0], (8, 9), [0]) == [5, 6]  # stopped at a model eos instead
    assert strip_end_of_turn([5, 6], (8, 9), [0]) == [5, 6]


# ---- seeds and config ----


def test_request_seeds_of_a_run_never_share_a_draw():
    # the engine draws with seed + output position, position < max_new_tokens < SEED_STRIDE;
    # CPU generators keep a seed's low 32 bits, so every seed and draw stays below 2**32
    for run_seed in (0, 1, 12345):
        starts = sorted(request_seed(run_seed, i) for i in range(0, mp.MAX_REQUESTS_PER_RUN, 997))
        assert all(b - a >= SEED_STRIDE for a, b in zip(starts, starts[1:]))
        assert 0 <= starts[0] and starts[-1] < 2**mp.SEED_BITS
    assert request_seed(0, 5) != request_seed(1, 5) and request_seed(7, 3) == request_seed(7, 3)
    with pytest.raises(ValueError):
        request_seed(0, mp.MAX_REQUESTS_PER_RUN)


def test_magpie_config_validates_and_builds_request_params():
    cfg = MagpieConfig(temperature=0.9, top_p=0.9, max_new_tokens=32, seed=2)
    assert cfg.sampling_params(3) == {"max_new_tokens": 32, "do_sample": True, "temperature": 0.9, "top_p": 0.9,
                                      "top_k": -1, "seed": request_seed(2, 3)}
    assert "seed" not in MagpieConfig(seed_mode="batch").sampling_params(0)
    for bad in (dict(count=0), dict(temperature=0.0), dict(top_p=1.5), dict(max_new_tokens=SEED_STRIDE),
                dict(seed=-1), dict(seed_mode="global"), dict(oversample=0.5)):
        with pytest.raises(ValueError):
            MagpieConfig(**bad)


# ---- the round loop, with a scripted engine ----


class ScriptedEngine:
    """Answers request i of run seed 0 (recovered from its seed) with script[i]: (words, reached the end of turn)."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls, self.prompts = tok, script, [], []

    def generate(self, prompts, params, eos_token_ids=(), progress=False, on_step=None):
        self.calls.append(len(prompts))
        self.prompts.append(prompts[0])
        out = []
        for sp in params:
            words, ended = self.script[(sp.seed - request_seed(0, 0)) % 2**mp.SEED_BITS // SEED_STRIDE]
            ids = self.tok.encode(words, add_special_tokens=False) + ([word_id(self.tok, "<end>")] if ended else [])
            out.append(SimpleNamespace(token_ids=ids, finish_reason="eos" if ended else "length", error=None))
        return out


def test_collect_prompts_samples_rounds_until_enough_survive():
    tok = tiny_tokenizer()
    script = [("w1 w2 w3 w4 w5", True), ("w1 w2 w3 w4 w5", True), ("w7 w8", True),  # round 1: 1 kept
              ("w9 w10 w11 w12", False), ("w1 w2 w3 w4 w5", True), ("w13 w14 w15 w16", True),
              ("w17 <turn> w18 w19", True), ("w20 w21 w22 w23", True), ("w24 w25 w26 w27", True)]
    engine = ScriptedEngine(tok, script)
    cfg = MagpieConfig(count=3, oversample=1.0, filter=FilterConfig(min_chars=8, min_words=3))
    got = collect_prompts(engine, tok, user_turn_prefix(tok), cfg, eos_token_ids=[])
    # round 2 asks for the 2 missing at round 1's yield (3 requests per kept prompt)
    assert engine.calls == [3, 6] and got.rounds == 2 and got.requests == 9
    assert got.prompts == ["w1 w2 w3 w4 w5", "w13 w14 w15 w16", "w20 w21 w22 w23"]  # count is a cap
    assert got.dropped[DROP_DUPLICATE] == 2 and got.dropped[DROP_SHORT] == 1
    assert got.dropped[DROP_OVERLONG] == 1 and got.dropped[DROP_TAG] == 1
    assert [r.kind for r in got.records()] == [mp.KIND_GENERAL] * 3
    # one default domain: every prompt is the default's, its share the whole count
    assert [r.domain for r in got.records()] == ["default"] * 3
    assert got.stats()["domains"] == ["default"]
    assert got.stats()["by_domain"] == {"default": {"system_prompt": None, "wanted": 3, "prompts": 3, "requests": 9,
                                                    "rounds": 2}}
    # naming the default domain explicitly changes nothing
    again = collect_prompts(ScriptedEngine(tok, script), tok, user_turn_prefix(tok),
                            dataclasses.replace(cfg, domains=("default",)), eos_token_ids=[])
    assert again.prompts == ["w1 w2 w3 w4 w5", "w13 w14 w15 w16", "w20 w21 w22 w23"] and again.requests == 9


def test_collect_prompts_stops_after_max_rounds():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, [("w1", True)] * 64)
    got = collect_prompts(engine, tok, user_turn_prefix(tok), MagpieConfig(count=2, max_rounds=2), [])
    assert got.prompts == [] and got.rounds == 2 and got.dropped[DROP_SHORT] == got.requests


# ---- domains ----


def test_domain_table():
    assert {"default", "code", "writing", "advice", "explanation"} <= set(MAGPIE_DOMAINS)
    assert MAGPIE_DOMAINS["default"] is None
    assert "programming assistant" in MAGPIE_DOMAINS["code"] and "Python" in MAGPIE_DOMAINS["code"]
    assert "writing assistant" in MAGPIE_DOMAINS["writing"]
    for name, text in MAGPIE_DOMAINS.items():
        assert name == "default" or (text.isascii() and text == text.strip() and len(text.split()) >= 5), name


def test_domain_counts_split_equally_with_the_remainder_first():
    assert domain_counts(10, 3) == [4, 3, 3]
    assert domain_counts(256, 5) == [52, 51, 51, 51, 51]
    assert domain_counts(12, 4) == [3, 3, 3, 3]
    assert domain_counts(2, 3) == [1, 1, 0]
    assert domain_counts(7, 1) == [7]


def test_domain_deadlines_split_the_time_budget_by_counts():
    assert domain_deadlines(100.0, 10.0, [2, 1, 1]) == [105.0, 107.5, 110.0]
    assert domain_deadlines(100.0, 10.0, [7]) == [110.0]
    assert domain_deadlines(100.0, None, [2, 1]) == [None, None]


def test_a_domain_prefix_carries_its_system_prompt():
    tok = tiny_tokenizer()
    prefixes = domain_prefixes(tok, MagpieConfig(domains=("default", "code")))
    assert list(prefixes) == ["default", "code"]
    assert prefixes["default"].text == DEFAULT_TINY_PREFIX  # the template's own system turn
    code = prefixes["code"].text
    assert code == "<s><turn>system\n" + MAGPIE_DOMAINS["code"] + "<end>\n<turn>user\n"
    assert "programming assistant" in code and "programming assistant" not in prefixes["default"].text
    assert prefixes["code"].tags == prefixes["default"].tags
    # the default domain takes MagpieConfig.system_prompt when one is set
    own = domain_prefixes(tok, MagpieConfig(system_prompt="Be brief.", domains=("default",)))
    assert own["default"].text == "<s><turn>system\nBe brief.<end>\n<turn>user\n"


def test_unknown_or_repeated_domains_are_rejected():
    with pytest.raises(ValueError, match="unknown Magpie domain\\(s\\) 'poetry'; " + VALID_DOMAINS_MESSAGE):
        MagpieConfig(domains=("code", "poetry"))
    with pytest.raises(ValueError, match=VALID_DOMAINS_MESSAGE):
        parse_domains("code,poetry")
    for bad in ("code,code", ""):
        with pytest.raises(ValueError):
            parse_domains(bad)
    with pytest.raises(ValueError, match="not the string"):
        MagpieConfig(domains="code")
    assert parse_domains("code, writing") == ("code", "writing")
    assert parse_domains("default") == ("default",) == MagpieConfig().domains


def test_collect_prompts_splits_the_count_over_domains():
    tok = tiny_tokenizer()
    script = [("w1 w2 w3 w4", True), ("w5 w6 w7 w8", True),  # default: 2 wanted, 2 kept in one round
              ("w1 w2 w3 w4", True),  # code, round 1: a duplicate of a default prompt
              ("w9 w10 w11 w12", True), ("w13 w14 w15 w16", True)]  # code, round 2: twice the rate, 1 wanted
    cfg = MagpieConfig(count=3, oversample=1.0, domains=("default", "code"),
                       filter=FilterConfig(min_chars=8, min_words=3))
    prefixes = domain_prefixes(tok, cfg)
    engine = ScriptedEngine(tok, script)
    got = collect_prompts(engine, tok, prefixes, cfg, eos_token_ids=[])
    # request indices (seeds) run on across domains: 0-1 default, 2-4 code
    assert engine.calls == [2, 1, 2]
    default_ids, code_ids = (tok.encode(prefixes[d].text, add_special_tokens=False) for d in ("default", "code"))
    assert default_ids != code_ids and engine.prompts == [default_ids, code_ids, code_ids]
    assert got.prompts == ["w1 w2 w3 w4", "w5 w6 w7 w8", "w9 w10 w11 w12"]
    assert got.records() == [PromptRecord("general", "magpie", "w1 w2 w3 w4", "default"),
                             PromptRecord("general", "magpie", "w5 w6 w7 w8", "default"),
                             PromptRecord("general", "magpie", "w9 w10 w11 w12", "code")]
    assert got.requests == 5 and got.rounds == 3 and got.dropped[DROP_DUPLICATE] == 1
    assert sum(got.dropped.values()) == 1
    assert got.shares == [DomainShare("default", None, wanted=2, prompts=2, requests=2, rounds=1),
                          DomainShare("code", MAGPIE_DOMAINS["code"], wanted=1, prompts=1, requests=3, rounds=2)]
    stats = got.stats()
    assert stats["domains"] == ["default", "code"] and stats["prompts"] == 3
    assert stats["by_domain"]["code"] == {"system_prompt": MAGPIE_DOMAINS["code"], "wanted": 1, "prompts": 1,
                                          "requests": 3, "rounds": 2}


def test_a_domain_with_no_share_samples_nothing():
    tok = tiny_tokenizer()
    engine = ScriptedEngine(tok, [("w1 w2 w3 w4", True), ("w5 w6 w7 w8", True)])
    cfg = MagpieConfig(count=2, oversample=1.0, domains=("default", "code", "writing"),
                       filter=FilterConfig(min_chars=8, min_words=3))
    got = collect_prompts(engine, tok, domain_prefixes(tok, cfg), cfg, eos_token_ids=[])
    assert engine.calls == [1, 1] and got.domains == ["default", "code"]
    assert got.shares[2] == DomainShare("writing", MAGPIE_DOMAINS["writing"], wanted=0, prompts=0, requests=0,
                                        rounds=0)


def test_sample_user_turns_cuts_at_a_plain_text_end_of_turn():
    # the stop is matched on token ids; a marker tokenised otherwise in context is cut from the text
    tok = tiny_tokenizer(INST_TEMPLATE)
    engine = ScriptedEngine(tok, [("w1 w2 w3 [/INST] w4 w5", False), ("w6 w7", False)])
    turns = sample_user_turns(engine, tok, user_turn_prefix(tok), MagpieConfig(), 0, 2, eos_token_ids=[])
    assert turns == [RawTurn("w1 w2 w3 ", True), RawTurn("w6 w7", False)]


# ---- seeded sampling through the engine (tiny random Llama, CPU) ----


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from unit_tests.models.tiny_checkpoints import build_hf_model, save_checkpoint

    return save_checkpoint(build_hf_model("llama", seed=0), str(tmp_path_factory.mktemp("magpie") / "t"), False)


def _sample(model_dir, cfg: MagpieConfig, batch: int, n: int = 6):
    from unit_tests.server.router.engine_util import make_engine

    tok = tiny_tokenizer()
    engine = make_engine(model_dir, running_max_req_size=batch, max_req_total_len=64)
    return sample_user_turns(engine, tok, user_turn_prefix(tok), cfg, 0, n, eos_token_ids=[])


def test_seeded_sampling_repeats_and_does_not_depend_on_the_batch(tiny_target):
    cfg = MagpieConfig(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=0)
    first = _sample(tiny_target, cfg, batch=6)
    assert _sample(tiny_target, cfg, batch=6) == first
    assert _sample(tiny_target, cfg, batch=2) == first  # one seed per request: batch-independent
    assert len({t.text for t in first}) > 1  # the requests differ from each other
    assert all(len(t.text.split()) <= 8 and (t.ended or len(t.text.split()) == 8) for t in first)
    other = _sample(tiny_target, MagpieConfig(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=1), batch=6)
    assert other != first
    batch_mode = MagpieConfig(max_new_tokens=8, temperature=1.0, top_p=0.95, seed=0, seed_mode="batch")
    assert _sample(tiny_target, batch_mode, batch=6) == _sample(tiny_target, batch_mode, batch=6)


def test_generate_magpie_prompts_over_domains_in_the_engine(tmp_path):
    from unit_tests.models.tiny_checkpoints import build_hf_model, save_checkpoint

    model_dir = save_checkpoint(build_hf_model("llama", seed=0), str(tmp_path / "t"), False)
    tiny_tokenizer().save_pretrained(model_dir)  # the engine loads the model dir's tokenizer
    # the random target seldom ends a turn: one round a domain, counted by share
    cfg = MagpieConfig(count=4, max_new_tokens=8, max_rounds=1, domains=("default", "code"), gen_batch_size=8)
    got = mp.generate_magpie_prompts(model_dir, cfg, device="cpu", dtype="float32")
    assert [(s.domain, s.wanted, s.requests, s.rounds) for s in got.shares] == [("default", 2, 4, 1),
                                                                               ("code", 2, 4, 1)]
    assert got.requests == 8 and got.rounds == 2 and sum(got.dropped.values()) + len(got.prompts) == 8
    assert got.prefix.text == DEFAULT_TINY_PREFIX


@pytest.mark.slow
def test_generate_magpie_prompts_with_the_embedded_model():
    from lightllm.utils import embedded_model

    try:
        model_dir = embedded_model.get_default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(f"embedded model unavailable: {e}")
    cfg = MagpieConfig(count=4, max_new_tokens=48, seed=0, gen_batch_size=8)
    got = mp.generate_magpie_prompts(model_dir, cfg, device="cpu", dtype="float32")
    assert 0 < len(got.prompts) <= 4 and len(set(got.prompts)) == len(got.prompts)
    assert all(not mp.has_template_tag(p, got.prefix.tags) for p in got.prompts)


# ---- mixing and prompt-set files ----


def _pools():
    general = as_records([f"general prompt {i}" for i in range(30)], mp.KIND_GENERAL, mp.SOURCE_MAGPIE)
    gsm8k = as_records([f"math question {i}" for i in range(20)], mp.KIND_MATH, mp.SOURCE_GSM8K)
    return general, gsm8k


def test_mix_prompts_keeps_the_ratio_and_is_seeded():
    general, gsm8k = _pools()
    mixed = mix_prompts(general, gsm8k, 0.25, 24, seed=3)
    assert Counter(r.source for r in mixed) == {mp.SOURCE_MAGPIE: 18, mp.SOURCE_GSM8K: 6}
    assert len(set(mixed)) == 24  # drawn without replacement
    assert mix_prompts(general, gsm8k, 0.25, 24, seed=3) == mixed
    assert mix_prompts(general, gsm8k, 0.25, 24, seed=4) != mixed
    sources = [r.source for r in mixed]
    assert sources != sorted(sources)  # shuffled together, not two blocks


def test_mix_counts_edges():
    assert mix_counts(30, 20, 0.0, None) == (30, 0)
    assert mix_counts(30, 20, 1.0, None) == (0, 20)
    assert mix_counts(30, 20, 0.5, None) == (20, 20)  # GSM8K is the limit
    assert mix_counts(30, 20, 0.25, None) == (30, 10)  # general is the limit: 40 in all
    with pytest.raises(ValueError, match="needs 25 general"):
        mix_counts(10, 20, 0.5, 50)
    with pytest.raises(ValueError, match="gsm8k_fraction"):
        mix_counts(10, 20, 1.5, None)


def test_prompt_set_round_trip(tmp_path):
    records = [PromptRecord("general", "magpie", "Line one\nline two, \"quoted\", ünïcode ✓"),
               PromptRecord("math", "gsm8k_train", "What is 2 + 3?")]
    path = str(tmp_path / "sub" / "prompts.jsonl")
    write_prompt_set(path, records)
    assert read_prompt_set(path) == records
    lines = open(path, encoding="utf-8").read().splitlines()
    assert len(lines) == 2 and set(json.loads(lines[0])) == {"kind", "source", "prompt"}
    (tmp_path / "bad.jsonl").write_text(json.dumps({"kind": "general", "prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: missing or non-string source"):
        read_prompt_set(str(tmp_path / "bad.jsonl"))


def test_prompt_set_keeps_a_magpie_domain(tmp_path):
    records = [PromptRecord("general", "magpie", "Write a loop in Python.", "code"),
               PromptRecord("math", "gsm8k_train", "What is 2 + 3?")]
    path = str(tmp_path / "prompts.jsonl")
    write_prompt_set(path, records)
    lines = [json.loads(line) for line in open(path, encoding="utf-8")]
    assert lines == [{"kind": "general", "source": "magpie", "prompt": "Write a loop in Python.", "domain": "code"},
                     {"kind": "math", "source": "gsm8k_train", "prompt": "What is 2 + 3?"}]
    assert read_prompt_set(path) == records
    (tmp_path / "bad.jsonl").write_text(json.dumps({"kind": "general", "source": "magpie", "prompt": "x",
                                                    "domain": 3}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: missing or non-string domain"):
        read_prompt_set(str(tmp_path / "bad.jsonl"))


# ---- the held-out set ----


def test_heldout_file_is_valid():
    rows = load_heldout()
    assert os.path.basename(DEFAULT_HELDOUT_PATH) == "heldout_prompts.jsonl"
    assert Counter(r["kind"] for r in rows) == HELDOUT_KIND_COUNTS
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({normalize_prompt(r["prompt"]) for r in rows}) == len(rows)  # no duplicates
    for r in rows:
        assert {"id", "kind", "prompt", "source"} <= set(r) and r["source"] == HELDOUT_SOURCE
        assert r["id"].startswith(r["kind"] + "-") and len(r["prompt"].split()) >= 4
        assert not mp.has_template_tag(r["prompt"], ())
    assert all(r.get("answer") for r in rows if r["kind"] == "math")


def test_heldout_is_not_gsm8k():
    from unit_tests.data_paths import require_gsm8k

    heldout = [r["prompt"] for r in load_heldout()]
    for split in ("train", "test"):
        with open(require_gsm8k(split)) as f:
            questions = [json.loads(line)["question"] for line in f if line.strip()]
        assert heldout_overlap(questions, heldout) == []


def test_heldout_overlap_matches_after_normalising():
    heldout = ["How do tides work?", "Write a haiku about coffee."]
    prompts = ["how do TIDES work", "How do waves work?", "Write a haiku about coffee!", "  write a haiku about coffee"]
    assert heldout_overlap(prompts, heldout) == [0, 2, 3]
    assert heldout_overlap([], heldout) == [] and heldout_overlap(prompts, []) == []
