# Export the merged store for downstream tools (config key `exports`, docs/exports.md): one
# job per format, streaming, written atomically.


rule export:
    input:
        f"{OUTDIR}/embeddings.h5",
    output:
        f"{OUTDIR}/exports/embeddings.{{ext}}",
    log:
        f"{OUTDIR}/logs/export-{{ext}}.log",
    conda:
        "../envs/embedpipe.yaml"
    params:
        fmt=export_format,
    wildcard_constraints:
        ext=export_formats.ext_pattern(),
    resources:
        mem_mb=2048,
        runtime=120,
    shell:
        "embedpipe export {input:q} --format {params.fmt} --out {output:q} > {log:q} 2>&1"
