import json
import os

from safetensors.torch import save_file


def fake_model_dir(tmp_path, name="model", **config) -> str:
    """A dir that passes the start-up checks (a config.json, a weights file, a tokenizer file); never loaded.
    ``config``: more config.json fields."""
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    (d / "tokenizer.json").write_text("{}")
    save_file({}, os.fspath(d / "model.safetensors"))
    return os.fspath(d)


def fake_draft_dir(tmp_path, name="draft", with_attention=True, **config) -> str:
    """An eagle / vanilla draft dir that passes the start-up checks (its config.json, a weights file); never
    loaded. ``config`` overrides its fields."""
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    fields = dict(model_type="llama_mtp", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, vocab_size=256, with_attention=with_attention)
    (d / "config.json").write_text(json.dumps({**fields, **config}))
    save_file({}, os.fspath(d / "model.safetensors"))
    return os.fspath(d)
