# One store over all shard stores, in which every input ID resolves (duplicates through
# aliases). HDF5 virtual datasets point into the shard stores, so nothing is copied: keep
# {outdir}/stores/ next to embeddings.h5.


rule merge:
    input:
        stores=shard_stores,
        manifest=f"{OUTDIR}/shards/manifest.tsv",
    output:
        f"{OUTDIR}/embeddings.h5",
    log:
        f"{OUTDIR}/logs/merge.log",
    conda:
        "../envs/embedpipe.yaml"
    resources:
        mem_mb=merge_mem_mb,
        runtime=60,
    shell:
        "embedpipe merge {input.stores:q} --out {output:q} --manifest {input.manifest:q}"
        " > {log:q} 2>&1"
