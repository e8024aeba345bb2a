#!/bin/bash
# The same small pipeline (shard, embed, merge, exports, crosscheck, reuse index) run with two checkouts, trees compared.
# Usage: BASE=/path/old-checkout NEW=/path/new-checkout bash scripts/compare-checkouts/pipeline.sh (0 differences: bit-identical)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export WORK=${WORK:-/tmp/compare-pipeline}
rm -rf "$WORK"; mkdir -p "$WORK"
python - <<'PY'
import os
import numpy as np
rng = np.random.default_rng(5)
amino = np.array(list("ACDEFGHIKLMNPQRSTVWY"))
lengths = [30, 75, 1400, 12, 2600, 500, 1023, 90, 1800, 40]
with open(os.environ["WORK"] + "/in.fasta", "w") as fh:
    for i, n in enumerate(lengths):
        seq = "".join(rng.choice(amino, n))
        fh.write(f">P{i} record {i}\n{seq}\n")
    fh.write(f">DUP1 same as P0\n{''.join(np.random.default_rng(5).choice(amino, 30))}\n")
PY
run() {  # $1 = side name, $2 = checkout
  local side=$1 src=$2 w=$WORK/$1
  mkdir -p "$w"
  export PYTHONPATH=$src
  cd "$w"
  embedpipe make-test-model model.pt --layers 2 --dim 32 --heads 4 --seed 3 > /dev/null
  embedpipe shard ../in.fasta --out shards --tokens-per-shard 3000 -q
  for s in shards/shard-*.fasta; do
    n=$(basename "$s" .fasta)
    embedpipe embed "$s" --model model.pt --out "stores/$n.h5" --layers 1,2 --per-residue --threads 1 -q
  done
  embedpipe merge stores/*.h5 --out merged.h5 --manifest shards/manifest.tsv -q
  embedpipe embed ../in.fasta --model model.pt --out truncate.h5 --long-sequences truncate --storage-dtype float16 --threads 1 -q
  embedpipe embed ../in.fasta --model model.pt --out full.h5 --long-sequences full --pooling mean --pooling bos --threads 1 -q
  embedpipe reuse-index merged.h5 --out merged.index.h5
  embedpipe export merged.h5 --format h5-per-id --out exports/e.h5 -q
  embedpipe export merged.h5 --format parquet --out exports/e.parquet -q
  embedpipe export merged.h5 --format npy --out exports/e.npy -q
  embedpipe export merged.h5 --format h5-per-id --per-residue --out exports/r.h5 -q
  embedpipe crosscheck merged.h5 --out crosscheck --sample 8 --threads 1 -q || echo "crosscheck exit $?"
  embedpipe info merged.h5 --json > info.json
  embedpipe validate merged.h5 > validate.txt
}
run main "${BASE:?set BASE to the old checkout}"
run wreg "${NEW:?set NEW to the new checkout}"
cd /tmp
python "$HERE"/pipeline_trees.py "$WORK/main" "$WORK/wreg"
