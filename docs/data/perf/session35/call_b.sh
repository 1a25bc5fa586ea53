#!/usr/bin/env bash
# Session 35, with the model in /root/m (two transfer calls before) and the whole tree (.dz, .whl carried):
# the overlap schedule with MTP against the step-by-step schedule end to end, one server each, eagle K = 3 at
# concurrency 64, all 1319 GSM8K test questions, B = 0 and the usage budget, 3 rounds interleaved
# (issue 25's MTP step bar was met in-process with overlap; this is its tok/s, and issue 26's decode batch).
source scripts/device/env.sh >/dev/null 2>&1
bash scripts/device/gpu_session.sh data >/dev/null 2>&1
S=$(date +%s); O=${OUT:?}
BUDGETS_ARMS="step=--disable_overlap_schedule;overlap=" BUDGETS_NAME=_overlap_ab timeout ${BUDGETS_S:-570} \
    bash scripts/device/gpu_session.sh budgets "$O/b" 3 64 "" 0,2.0625
echo "total $(( $(date +%s) - S )) s"
gzip -f "$O"/b/*.log
