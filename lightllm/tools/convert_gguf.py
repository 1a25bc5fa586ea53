"""Convert a Llama GGUF file into a Hugging Face model dir (cached and atomic).

    python -m lightllm.tools.convert_gguf [--gguf PATH] [--out DIR] [--force]

A thin CLI: the conversion is lightllm/utils/gguf_convert.py, the cache and its
atomic update lightllm/utils/embedded_model.py.
"""
import argparse
import os
import time

from lightllm.utils.embedded_model import default_model_dir_path, ensure_converted, find_embedded_gguf


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a Llama GGUF file into a Hugging Face model dir.")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", default=None, help="output model dir (default: the lightllm cache dir)")
    parser.add_argument("--force", action="store_true", help="convert again even if the output is up to date")
    args = parser.parse_args(argv)

    gguf_path = args.gguf or find_embedded_gguf()
    out_dir = args.out or default_model_dir_path()
    print(f"converting {gguf_path} -> {out_dir}")
    start = time.monotonic()
    model_dir = ensure_converted(gguf_path, out_dir, force=args.force)
    size_mib = sum(entry.stat().st_size for entry in os.scandir(model_dir) if entry.is_file()) / 2**20
    print(f"model dir ready: {model_dir} ({size_mib:.0f} MiB, {time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    main()
