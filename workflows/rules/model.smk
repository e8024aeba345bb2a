# The model: fetched once (fair-esm name) or generated (test model); a user's checkpoint
# path needs no rule. Both rules run on the submitting host (localrule): on a cluster the
# login node has the internet access that compute nodes often lack.

if MODEL_KIND == "name":

    rule fetch_model:
        output:
            fetched_model_record(),
        log:
            f"{OUTDIR}/logs/fetch_model.log",
        conda:
            "../envs/embedpipe.yaml"
        params:
            name=MODEL,
        localrule: True
        priority: 100
        # stderr goes to the log and the terminal: offline, the one-line error says how to
        # pre-fetch, use a local checkpoint, or run configs/offline-demo.yaml.
        shell:
            "{{ embedpipe fetch-model {params.name:q} > {output:q}; }} 2>&1 | tee {log:q}"


if MODEL_KIND == "test":

    rule make_test_model:
        output:
            model=MODEL,
            companion=test_model_companion(),
        log:
            f"{OUTDIR}/logs/make_test_model.log",
        conda:
            "../envs/embedpipe.yaml"
        params:
            layers=config["test_model"]["layers"],
            dim=config["test_model"]["dim"],
            heads=config["test_model"]["heads"],
            seed=config["test_model"]["seed"],
        localrule: True
        shell:
            "embedpipe make-test-model {output.model:q} --layers {params.layers}"
            " --dim {params.dim} --heads {params.heads} --seed {params.seed} > {log:q} 2>&1"
