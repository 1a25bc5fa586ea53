"""Every server flag, with help text (LightLLM names)."""
import argparse

from lightllm.server.core.objs.start_args_type import DATA_TYPES, MTP_MODES, StartArgs


def make_argument_parser() -> argparse.ArgumentParser:
    d = StartArgs()
    p = argparse.ArgumentParser(prog="python -m lightllm.server.api_server", description="LightLLM-shaped LLM server")
    p.add_argument("--model_dir", type=str, default=d.model_dir,
                   help="Hugging Face model dir (config.json + safetensors). Default: the embedded SmolLM2-135M-Instruct.")
    p.add_argument("--host", type=str, default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--max_total_token_num", type=int, default=d.max_total_token_num,
                   help="KV cache pool size in tokens (default: sized from free memory).")
    p.add_argument("--running_max_req_size", type=int, default=d.running_max_req_size,
                   help="Most requests running at once.")
    p.add_argument("--max_req_total_len", type=int, default=d.max_req_total_len,
                   help="Most prompt + generated tokens of one request.")
    p.add_argument("--batch_max_tokens", type=int, default=d.batch_max_tokens,
                   help="Most prompt tokens prefilled in one step (chunked prefill chunk budget).")
    p.add_argument("--data_type", type=str, default=d.data_type, choices=DATA_TYPES,
                   help="Weights and KV dtype (default: bfloat16 on CUDA, float32 on CPU).")
    p.add_argument("--mtp_mode", type=str, default=d.mtp_mode, choices=MTP_MODES,
                   help="MTP speculative decoding mode (default: off).")
    p.add_argument("--mtp_step", type=int, default=d.mtp_step, help="Draft tokens per decode step (K).")
    p.add_argument("--mtp_draft_model_dir", type=str, nargs="+", default=d.mtp_draft_model_dir,
                   help="Draft module dir(s): vanilla chains K modules, eagle reuses one.")
    p.add_argument("--mtp_asd_regret_budget", type=float, default=d.mtp_asd_regret_budget,
                   help="ASD: per-request total regret budget B (unset: strict verification; 0: strict via ASD path).")
    p.add_argument("--mtp_asd_local_regret_ratio", type=float, default=d.mtp_asd_local_regret_ratio,
                   help="ASD: local cap g on regret / suffix value (unset: no local gate).")
    p.add_argument("--mtp_asd_block_max_mismatch", type=int, default=d.mtp_asd_block_max_mismatch,
                   help="ASD: most relaxed tokens per verify step m (unset: no cap).")
    return p
