import json
import os

from safetensors.torch import save_file


def fake_model_dir(tmp_path, name="model") -> str:
    """A dir that passes the start-up checks (a config.json, a weights file, a tokenizer file); never loaded."""
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "tokenizer.json").write_text("{}")
    save_file({}, os.fspath(d / "model.safetensors"))
    return os.fspath(d)
