"""The proposers report their own KV needs (DraftKvNeeds) and have the calls of ``Proposer``."""
import json
import typing

from lightllm.server.router.model_infer.mtp_speculative.draft import DraftProposer, proposer_class
from lightllm.server.router.model_infer.mtp_speculative.dspark import DSparkProposer
from lightllm.server.router.model_infer.mtp_speculative.proposer import DraftKvNeeds, Proposer
from unit_tests.models.tiny_checkpoints import tiny_model


def test_the_registry_names_a_class_per_mode():
    assert proposer_class("dspark") is DSparkProposer
    for mode in ("eagle_with_att", "vanilla_with_att", "eagle_no_att", "vanilla_no_att"):
        assert proposer_class(mode) is DraftProposer


def test_kv_needs_of_each_proposer(tmp_path):
    from lightllm.models.dspark.train_module import random_dspark_draft

    tiny = tiny_model("llama", tmp_path)
    assert DraftProposer.kv_needs([tiny.draft("eagle")], 3) == DraftKvNeeds(kv_layers=None, extra_positions=0)
    block = 4
    draft = random_dspark_draft(tiny.hf.config, str(tmp_path / "dspark"), seed=3, block_size=block)
    layers = json.load(open(f"{draft}/config.json"))["num_hidden_layers"]
    assert DSparkProposer.kv_needs([draft], 3) == DraftKvNeeds(kv_layers=layers, extra_positions=block)


def test_both_proposers_have_the_protocols_members():
    members = [m for m in dir(Proposer) if not m.startswith("_")] + list(typing.get_type_hints(Proposer))
    for cls in (DraftProposer, DSparkProposer):
        for name in members:
            assert hasattr(cls, name) or name == "mtp_step", (cls.__name__, name)
