#!/usr/bin/env bash
# Fifty-first session, last call: the server's wait for returning clients (`serve --gather-ms`,
# 10 by default; 0 the old behaviour). The 64 clients end their requests together every 128
# tokens; without the wait they come back over two steps and the steps carry 63.0 of 64 rows.
# Steady windows of 20 s each (the server's counters). ~2.5 minutes.
#   tools/gpu/plans/gpu-next173.sh BIN 2>&1 | tee $OUT/log.txt | tail -40
set -u
B=$1
source "$(dirname "$0")/lib.sh"
q8_ready
serve64 "" 20 "--row-multiple 4"
serve64 "" 20 "--row-multiple 4 --gather-ms 0"
stamp "== done"
