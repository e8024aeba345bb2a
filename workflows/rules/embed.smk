# One embed job per shard: load the model once, embed every record, write one store
# (atomically). Retried with a smaller token budget per batch (tokens_per_batch // attempt).
# With a CUDA device the job requests one GPU; `embedpipe embed` locks a GPU of its own when
# several jobs share a multi-GPU machine (`snakemake --resources gpu=N`).


rule embed:
    input:
        fasta=f"{OUTDIR}/shards/shard-{{shard}}.fasta",
        model=model_input(),
    output:
        f"{OUTDIR}/stores/shard-{{shard}}.h5",
    log:
        f"{OUTDIR}/logs/embed/shard-{{shard}}.log",
    conda:
        "../envs/embedpipe.yaml"
    benchmark:
        f"{OUTDIR}/benchmarks/embed/shard-{{shard}}.tsv"
    params:
        model=model_arg,
        options=embed_options(),
    threads: 4
    retries: EMBED_RETRIES
    resources:
        gpu=gpus,
        mem_mb=lambda wildcards, attempt: model_mem_mb(attempt),
        runtime=lambda wildcards, attempt: 120 * attempt,
        tokens_per_batch=tokens_per_batch,
    shell:
        "embedpipe embed {input.fasta:q} --model {params.model:q} --out {output:q}"
        " {params.options} --tokens-per-batch {resources.tokens_per_batch}"
        " --threads {threads} > {log:q} 2>&1"
