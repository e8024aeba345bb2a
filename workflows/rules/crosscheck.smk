# Re-embed a random sample of the merged store, and its riskiest records (the longest, those over
# the model's window, the fp32 fallbacks), in fp32 and compare: crosscheck.json for
# machines, crosscheck.html for people (also part of `snakemake --report`). With
# `crosscheck: {labels: PATH}` the sample is drawn from the labelled records and the downstream
# result on those labels is compared too (docs/crosscheck.md, "Downstream: your own labels").


rule crosscheck:
    input:
        store=f"{OUTDIR}/embeddings.h5",
        model=model_input(),
        labels=crosscheck_labels(),
    output:
        json=f"{OUTDIR}/crosscheck/crosscheck.json",
        html=report(
            f"{OUTDIR}/crosscheck/crosscheck.html",
            caption="../report/crosscheck.rst",
            category="Cross-check",
            labels={"report": "fp32 cross-check"},
        ),
    log:
        f"{OUTDIR}/logs/crosscheck.log",
    conda:
        "../envs/embedpipe.yaml"
    params:
        outdir=lambda wildcards, output: os.path.dirname(output.json),
        model=model_arg,
        options=crosscheck_options(),
        labels=crosscheck_label_options(),
    threads: JOB_THREADS
    resources:
        gpu=gpus,
        mem_mb=lambda wildcards, attempt: model_mem_mb(attempt),
        runtime=120,
    shell:
        "embedpipe crosscheck {input.store:q} --out {params.outdir:q} --model {params.model:q}"
        " {params.options} {params.labels}"
        f" {THREADS_OPTION}"
        " > {log:q} 2>&1"
