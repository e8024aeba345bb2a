#!/bin/bash
# The same embeds (fp32, bf16-mixed, int8, smoothquant, windows, ProtT5, three --reuse cases) with two checkouts, stores compared.
# Usage: BASE=/path/old NEW=/path/new bash scripts/compare-checkouts/embeds.sh [main|wt|compare|all]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
W=/tmp/compare-embeds
mkdir -p $W/in
step=${1:-all}
if [ ! -e $W/in/model.pt ]; then
  PYTHONPATH="$NEW" embedpipe make-test-model $W/in/model.pt --layers 2 --dim 32 --heads 4 --seed 3
  PYTHONPATH="$NEW" embedpipe make-test-model $W/in/t5 --family prot-t5 --layers 2 --dim 32 --heads 4 --seed 3
  PYTHONPATH="$NEW" python - <<'PY'
import numpy as np
rng = np.random.default_rng(0)
aa = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
def write(path, n, seed, lo=5, hi=300):
    r = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(f">s{seed}_{i}\n{''.join(r.choice(aa, int(r.integers(lo, hi))))}\n")
write("/tmp/compare-embeds/in/a.fasta", 40, 1)
write("/tmp/compare-embeds/in/long.fasta", 6, 4, 900, 1400)  # windows
# b: half of a's records plus new ones (the reuse run)
a = open("/tmp/compare-embeds/in/a.fasta").read().split(">")[1:21]
with open("/tmp/compare-embeds/in/b.fasta", "w") as f:
    f.write("".join(">" + r for r in a))
write("/tmp/compare-embeds/in/b_new.fasta", 15, 2)
open("/tmp/compare-embeds/in/b.fasta", "a").write(open("/tmp/compare-embeds/in/b_new.fasta").read())
PY
fi
run() {  # side name
  local side=$1 src; src=$([ "$side" = main ] && echo "$BASE" || echo "$NEW")
  local o=$W/$side; rm -rf $o; mkdir -p $o
  export PYTHONPATH=$src
  local M=$W/in/model.pt
  local common="--device cpu -q --layers 0,-1"
  embedpipe embed $W/in/a.fasta --model $M --out $o/fp32.h5 $common --per-residue --pooling mean --pooling bos
  embedpipe embed $W/in/a.fasta --model $M --out $o/bf16.h5 $common --precision bf16-mixed --per-residue --storage-dtype float16
  embedpipe embed $W/in/a.fasta --model $M --out $o/int8.h5 $common --precision int8-mixed
  embedpipe embed $W/in/a.fasta --model $M --out $o/int8sq.h5 $common --precision int8-mixed --int8-smoothing smoothquant
  embedpipe embed $W/in/long.fasta --model $M --out $o/long.h5 $common --per-residue --tokens-per-batch 1500
  embedpipe embed $W/in/a.fasta --model $W/in/t5 --out $o/t5.h5 --device cpu -q --precision bf16-mixed
  # reuse: a store of a, then b with --reuse (half copied, half computed), and an all-reused group
  embedpipe embed $W/in/b.fasta --model $M --out $o/reuse.h5 $common --per-residue --pooling mean --pooling bos --reuse $o/fp32.h5
  embedpipe reuse-index $o/fp32.h5 --out $o/fp32.idx.h5
  embedpipe embed $W/in/a.fasta $W/in/b_new.fasta --model $M --out-dir $o/group --done $o/group/done.json $common --per-residue --pooling mean --pooling bos --reuse $o/fp32.idx.h5
}
[ "$step" = main ] || [ "$step" = all ] && run main
[ "$step" = wt ] || [ "$step" = all ] && run wt
if [ "$step" = compare ] || [ "$step" = all ]; then
  rc=0
  for f in fp32 bf16 int8 int8sq long t5 reuse group/a group/b_new; do
    PYTHONPATH="$NEW" python "$HERE"/store_pair.py $W/main/$f.h5 $W/wt/$f.h5 || rc=1
  done
  cmp <(python -c "import json;d=json.load(open('$W/main/group/done.json'));print(sorted(d) if isinstance(d,dict) else d)") \
      <(python -c "import json;d=json.load(open('$W/wt/group/done.json'));print(sorted(d) if isinstance(d,dict) else d)") && echo "done markers: same keys" || rc=1
  exit $rc
fi
