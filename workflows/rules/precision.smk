# `precision: auto` decided once for the run, before any embed job (docs/precision.md, "One
# decision per run"): `embedpipe decide-precision` measures the candidates on records drawn
# across the whole input, on the resources an embed job gets (the embed rule's threads, and what
# a profile sets for embed: partition, constraint, GPU type), and writes the decision every
# embed job runs (`--precision auto:DECISION`). A run too small to pay for the probe (the
# shards' residues: --run-residues) is not measured unless `auto_measure: always`. A rerun keeps
# it unless the model or an option that decides the numbers changed (the command compares the
# file's key).


rule decide_precision:
    input:
        # as the embed rule's: the shard checkpoint's outputs (params read them) and the model
        listing=f"{OUTDIR}/shards/shards.json",
        manifest=f"{OUTDIR}/shards/manifest.tsv",
        model=model_input(),
    output:
        DECISION,
    log:
        f"{OUTDIR}/logs/decide_precision.log",
    conda:
        "../envs/embedpipe.yaml"
    params:
        shards=decision_shards,
        residues=run_residues,
        model=model_arg,
        options=decide_options(),
    resources:
        gpu=gpus,
        mem_mb=lambda wildcards, attempt: model_mem_mb(attempt),
        runtime=lambda wildcards, attempt: embed_runtime(attempt),
    shell:
        "embedpipe decide-precision {params.shards:q} --model {params.model:q} --out {output:q}"
        " --run-residues {params.residues} {params.options}"
        f" {THREADS_OPTION}"
        " > {log:q} 2>&1"


as_embed_job(rules.decide_precision.rule)  # threads and profile resources: the embed rule's
