# Re-embed a random sample of the merged store in fp32 and compare: crosscheck.json for
# machines, crosscheck.html for people (also part of `snakemake --report`). With
# `crosscheck: {labels: PATH}` the sample is drawn from the labelled records and the downstream
# result on those labels is compared too (docs/crosscheck.md, "Downstream: your own labels").


def crosscheck_labels():
    """The label file as an input (a changed file re-runs the cross-check), or none."""
    labels = config["crosscheck"].get("labels")
    return [labels] if labels else []


def crosscheck_label_options():
    """--labels and its companions from the `crosscheck` config key ("" without labels)."""
    cc = config["crosscheck"]
    if not cc.get("labels"):
        return ""
    words = ["--labels", cc["labels"], "--label-kind", cc.get("label_kind", "auto")]
    if cc.get("ignore_unknown_ids"):
        words.append("--ignore-unknown-ids")
    return _join(words)


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
    threads: 4
    resources:
        gpu=gpus,
        mem_mb=lambda wildcards, attempt: model_mem_mb(attempt),
        runtime=120,
    shell:
        "embedpipe crosscheck {input.store:q} --out {params.outdir:q} --model {params.model:q}"
        " {params.options} {params.labels} --threads {threads}"
        " > {log:q} 2>&1"
