#!/bin/bash
# The same embeds (every policy on ESM-2, fp32/bf16-mixed/int8-mixed on each Hugging Face family,
# smoothquant, windows, three --reuse cases) with two checkouts, stores compared. Attributes that
# record options NEW removed (REMOVED) and the timed choice of int8 engine are listed, not failed.
# Usage: BASE=/path/old NEW=/path/new bash scripts/compare-checkouts/embeds.sh [main|wt|compare|all]
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
W=/tmp/compare-embeds
mkdir -p $W/in
step=${1:-all}
ESM2_POLICIES="fp16 bf16 amp-fp16 amp-bf16 fp16-mixed"  # fp32, bf16-mixed and int8-mixed run below
FAMILY_POLICIES="fp32 bf16-mixed int8-mixed"
REMOVED=${REMOVED:-compiled,compile_reason,compile_s,compile,compile_cache,attention,batch_layout,attention_inputs,fallback_device}
if [ ! -e $W/in/model.pt ]; then
  PYTHONPATH="$NEW" embedpipe make-test-model $W/in/model.pt --layers 2 --dim 32 --heads 4 --seed 3
  PYTHONPATH="$NEW" embedpipe make-test-model $W/in/t5 --family prot-t5 --layers 2 --dim 32 --heads 4 --seed 3
  for fam in hf-esm ankh esmc; do
    PYTHONPATH="$NEW" embedpipe make-test-model $W/in/$fam --family $fam --layers 2 --dim 32 --heads 4 --seed 3
  done
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
  for p in $ESM2_POLICIES; do
    embedpipe embed $W/in/a.fasta --model $M --out $o/esm2-$p.h5 $common --precision $p
  done
  for fam in t5 hf-esm ankh esmc; do
    for p in $FAMILY_POLICIES; do
      embedpipe embed $W/in/a.fasta --model $W/in/$fam --out $o/$fam-$p.h5 --device cpu -q --layers 0,-1 --precision $p
    done
  done
  # reuse: a store of a, then b with --reuse (half copied, half computed), and an all-reused group
  embedpipe embed $W/in/b.fasta --model $M --out $o/reuse.h5 $common --per-residue --pooling mean --pooling bos --reuse $o/fp32.h5
  embedpipe reuse-index $o/fp32.h5 --out $o/fp32.idx.h5
  embedpipe embed $W/in/a.fasta $W/in/b_new.fasta --model $M --out-dir $o/group --done $o/group/done.json $common --per-residue --pooling mean --pooling bos --reuse $o/fp32.idx.h5
}
[ "$step" = main ] || [ "$step" = all ] && run main
[ "$step" = wt ] || [ "$step" = all ] && run wt
if [ "$step" = compare ] || [ "$step" = all ]; then
  rc=0
  stores="fp32 bf16 int8 int8sq long t5 reuse group/a group/b_new"
  for p in $ESM2_POLICIES; do stores="$stores esm2-$p"; done
  for fam in t5 hf-esm ankh esmc; do for p in $FAMILY_POLICIES; do stores="$stores $fam-$p"; done; done
  for f in $stores; do
    PYTHONPATH="$NEW" python "$HERE"/store_pair.py $W/main/$f.h5 $W/wt/$f.h5 --removed "$REMOVED" \
      --timed quantization_engines || rc=1
  done
  cmp <(python -c "import json;d=json.load(open('$W/main/group/done.json'));print(sorted(d) if isinstance(d,dict) else d)") \
      <(python -c "import json;d=json.load(open('$W/wt/group/done.json'));print(sorted(d) if isinstance(d,dict) else d)") && echo "done markers: same keys" || rc=1
  exit $rc
fi
