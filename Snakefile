# embedpipe: FASTA -> length-sorted shards -> ESM-2 embeddings (HDF5) -> fp32 cross-check.
#
#   snakemake --cores 8                                   # configs/config.yaml
#   snakemake --cores 8 --config precision=fp16           # override any key
#   snakemake --cores 4 --configfile configs/offline-demo.yaml
#   snakemake --workflow-profile workflows/profiles/slurm --configfile configs/gpu-proteome.yaml
#
# Config keys and defaults: workflows/schemas/config.schema.yaml. Outputs: {outdir}/shards/
# manifest.tsv, {outdir}/embeddings.h5, {outdir}/crosscheck/crosscheck.{json,html}.

from snakemake.utils import min_version

min_version("8.0")


configfile: "configs/config.yaml"


report: "workflows/report/workflow.rst"


wildcard_constraints:
    group=r"\d+",


include: "workflows/rules/common.smk"
include: "workflows/rules/model.smk"
include: "workflows/rules/shard.smk"
include: "workflows/rules/embed.smk"
include: "workflows/rules/precision.smk"
include: "workflows/rules/merge.smk"
include: "workflows/rules/crosscheck.smk"
include: "workflows/rules/export.smk"


rule all:
    input:
        final_outputs(),
    default_target: True
