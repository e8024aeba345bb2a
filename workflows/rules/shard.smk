# Validate, normalise, dedupe and length-sort the input into token-budget shards. A
# checkpoint: the data decides how many shards (and so embed jobs) there are.


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
    resources:
        mem_mb=shard_mem_mb,
        runtime=60,
    shell:
        "embedpipe shard {input.fasta:q} --out {params.outdir:q}"
        " --tokens-per-shard {params.tokens_per_shard} --on-invalid {params.on_invalid}"
        " > {log:q} 2>&1"
