"""The engine modes the embedded-model GPU tests compare (StartArgs fields per mode)."""
MTP = dict(mtp_mode="eagle_with_att", mtp_step=3)
MODES = {
    "plain": {},
    "mtp": MTP,
    "asd0": dict(MTP, mtp_asd_regret_budget=0.0),
    "asd_usage": dict(MTP, mtp_asd_regret_budget=2.0625, mtp_asd_local_regret_ratio=0.25, mtp_asd_block_max_mismatch=2),
}
