# Validate, normalise, dedupe and length-sort the input into token-budget shards. A
# checkpoint: the data decides how many shards there are; shards.json also groups them into at
# most `max_jobs` embed jobs.


checkpoint shard:
    input:
        fasta=input_fastas(),
        model=model_gate(),
    output:
        manifest=f"{OUTDIR}/shards/manifest.tsv",
        listing=f"{OUTDIR}/shards/shards.json",
    log:
        f"{OUTDIR}/logs/shard.log",
    conda:
        "../envs/embedpipe.yaml"
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.manifest),
        tokens_per_shard=config["tokens_per_shard"],
        on_invalid=config["on_invalid"],
        options=shard_options(),
        max_jobs=config["max_jobs"],
    resources:
        mem_mb=shard_mem_mb,
        runtime=60,
    shell:
        "embedpipe shard {input.fasta:q} --out {params.outdir:q}"
        " --tokens-per-shard {params.tokens_per_shard} --on-invalid {params.on_invalid}"
        " --max-jobs {params.max_jobs} {params.options}"
        " > {log:q} 2>&1"
