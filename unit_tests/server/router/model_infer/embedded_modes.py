"""The engine modes the embedded-model GPU tests compare (StartArgs fields per mode)."""
MTP = dict(mtp_mode="eagle_with_att", mtp_step=3)
MODES = {
    "plain": {},
    "mtp": MTP,
    "asd0": dict(MTP, mtp_asd_regret_budget=0.0),
    "asd_usage": dict(MTP, mtp_asd_regret_budget=2.0625, mtp_asd_local_regret_ratio=0.25, mtp_asd_block_max_mismatch=2),
}


def run_embedded(args, prompts):
    """Generate on CUDA in bf16 (request i: 24 + 9 i new tokens, ignore_eos), then free the engine.
    Returns (results, whether CUDA graphs were captured: the decode graphs, and the prefill
    rows' graphs unless --graph_max_prefill_tokens is 0)."""
    import gc

    import torch

    from lightllm.server.offline_engine import OfflineEngine

    eng = OfflineEngine(args, device="cuda", dtype="bfloat16")
    params = [{"max_new_tokens": 24 + 9 * i, "ignore_eos": True} for i in range(len(prompts))]
    res = eng.generate(prompts, params)
    rows = eng.backend.step_rows
    captured = eng.backend.decode_step.graphs is not None and (rows is None or rows.graphs is not None)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return res, captured
