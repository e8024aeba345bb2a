# One store over all shard stores, in which every input ID resolves (duplicates through
# aliases). HDF5 virtual datasets point into the shard stores, so nothing is copied: keep
# {outdir}/stores/ next to embeddings.h5. Its inputs are the embed groups' markers (one per
# job), its stores every shard's store (listed in stores/merge-stores.txt for the command).


rule merge:
    input:
        groups=group_markers,
        manifest=f"{OUTDIR}/shards/manifest.tsv",
    output:
        f"{OUTDIR}/embeddings.h5",
    log:
        f"{OUTDIR}/logs/merge.log",
    conda:
        "../envs/embedpipe.yaml"
    params:
        stores=shard_stores,
        listing=f"{OUTDIR}/stores/merge-stores.txt",
    resources:
        mem_mb=merge_mem_mb,
        runtime=60,
    # The store paths go through a file, not argv: 16,000 of them exceed ARG_MAX. `printf` is
    # a shell builtin (no execve, so no limit); docs/cluster.md, "A UniRef50-sized run".
    shell:
        "printf '%s\\n' {params.stores:q} > {params.listing:q}"
        " && embedpipe merge --stores-from {params.listing:q} --out {output:q} --manifest {input.manifest:q}"
        " > {log:q} 2>&1"
