rule ref_cache:
    """Reference log-probs of every pair through one forward path, keyed by six components."""
    input:
        script=SCRIPTS / "ref_cache.py",
        gate=PATHS.sft_gate,
        manifest=PATHS.manifest,
        shards=lambda w: arm_shards(w.arm),
        config=lambda w: arm_toml(w.arm),
    output:
        train=PATHS.results / "{arm}" / "ref" / "{forward_impl}" / "train.safetensors",
        held=PATHS.results / "{arm}" / "ref" / "{forward_impl}" / "held.safetensors",
        receipt=PATHS.results / "{arm}" / "ref" / "{forward_impl}" / "receipt.json",
    log:
        PATHS.log("ref_cache", "{arm}-{forward_impl}"),
    benchmark:
        PATHS.benchmark("ref_cache", "{arm}-{forward_impl}")
    threads: config["threads"]
    params:
        run=RUN_OVERRIDES,
        ref=ref_overrides,
    shell:
        "python {input.script} {input.config} {params.run} --run.threads={threads}"
        " {params.ref} > {log} 2>&1"
