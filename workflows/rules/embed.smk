# One embed job per group of shards (shards.json `groups`; at most `max_jobs` jobs whatever the
# input, docs/cluster.md): load the model once, write one store per shard (atomically), keep a
# shard store that is already complete for the same shard, model and options, so a retried or
# rerun job resumes at shard granularity. The job's output is the group marker, written last;
# the shard stores are not outputs, so Snakemake never deletes finished ones before a rerun.
# Retried with a smaller token budget per batch (tokens_per_batch // attempt; `auto` is sized
# again from the device's free memory on each attempt), unless the job refused its inputs or
# was interrupted by the user. With a CUDA device the job requests one GPU; `embedpipe embed`
# locks a GPU of its own when several jobs share a multi-GPU machine (`snakemake --resources gpu=N`).


rule embed:
    input:
        # The shard FASTAs are a param, not inputs: Snakemake sizes every input of every
        # waiting job in each scheduling round, which grew with jobs x shards (docs/benchmarks.md,
        # "Workflow overhead"). A new shard run (a new shards.json) reruns every group; stores
        # whose shard content did not change are kept.
        listing=f"{OUTDIR}/shards/shards.json",
        # the checkpoint's outputs as inputs: a cluster job's inner Snakemake refuses params
        # that read a checkpoint whose outputs the rule does not take
        manifest=f"{OUTDIR}/shards/manifest.tsv",
        model=model_input(),
        # `reuse`: each earlier store's sha256 index; a job copies what it holds (docs/cluster.md)
        reuse=reuse_indexes(),
        # `int8_calibration`: a changed calibration file reruns the embed jobs
        calibration=calibration_input(),
        # `precision: auto`: the run's one decision (rule decide_precision), run by every job
        decision=decision_input(),
    output:
        f"{OUTDIR}/stores/group-{{group}}.json",
    log:
        f"{OUTDIR}/logs/embed/group-{{group}}.log",
    conda:
        "../envs/embedpipe.yaml"
    benchmark:
        f"{OUTDIR}/benchmarks/embed/group-{{group}}.tsv"
    params:
        shards=group_shards,
        model=model_arg,
        options=embed_options(),
        stores=lambda wildcards, output: os.path.dirname(output[0]),
        reuse=reuse_options(),
    threads: JOB_THREADS
    # EMBEDPIPE_AUTO_CACHE in the job's environment, not params (it changes how a job runs, not
    # its numbers): every embed job of the run shares it (docs/precision.md)
    # A retry of a job that refused its inputs (the CLI's user error) or that the user
    # interrupted (SIGINT; SIGTERM outside SLURM) gets the first attempt's resources and
    # repeats that failure at once; running out of memory is retried with more
    # (embedpipe.workflow.jobs; docs/cluster.md).
    retries: EMBED_RETRIES
    resources:
        gpu=gpus,
        mem_mb=lambda wildcards, attempt: model_mem_mb(embed_attempt(wildcards, attempt)),
        runtime=lambda wildcards, attempt: embed_runtime(embed_attempt(wildcards, attempt)),
        tokens_per_batch=tokens_per_batch,
        repeat=embed_repeat,
    shell:
        "python -m embedpipe.workflow.jobs start {log:q} {resources.repeat}"
        f" && {{{{ EMBEDPIPE_AUTO_CACHE={AUTO_CACHE}"
        " embedpipe embed {params.shards:q} --model {params.model:q} --out-dir {params.stores:q}"
        " --done {output:q} {params.options} {params.reuse} --tokens-per-batch {resources.tokens_per_batch}"
        f" {THREADS_OPTION}"
        " > {log:q} 2>&1 || python -m embedpipe.workflow.jobs failed {log:q} $?; }}"


# `reuse`: one sorted sha256 index per earlier store, built once (memory bounded by an external
# sort), so no embed job reads the earlier store's sequences (docs/cluster.md, "Release to release").


rule reuse_index:
    input:
        store=lambda wildcards: config["reuse"][int(wildcards.k)],
    output:
        f"{OUTDIR}/reuse/reuse-{{k,\\d+}}.h5",
    log:
        f"{OUTDIR}/logs/reuse_index/reuse-{{k}}.log",
    conda:
        "../envs/embedpipe.yaml"
    resources:
        mem_mb=1024,
        runtime=120,
    shell:
        "embedpipe reuse-index {input.store:q} --out {output:q} > {log:q} 2>&1"
