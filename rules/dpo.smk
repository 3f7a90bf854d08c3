rule dpo:
    """Re-check every gate, train the arm against its reference cache, evaluate held-out."""
    input:
        script=SCRIPTS / "dpo.py",
        gate=PATHS.sft_gate,
        manifest=PATHS.manifest,
        caches=dpo_ref_caches,
        config=lambda w: arm_toml(w.arm),
    output:
        PATHS.results / "{arm}" / "arm_result.json",
    log:
        PATHS.log("dpo", "{arm}"),
    benchmark:
        PATHS.benchmark("dpo", "{arm}")
    threads: config["threads"]
    params:
        run=RUN_OVERRIDES,
    shell:
        "python {input.script} {input.config} {params.run} --run.threads={threads} > {log} 2>&1"
