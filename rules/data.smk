rule build_manifest:
    """Filter, tokenize, split and shard every arm; counts, pins, DESCOPED arms."""
    input:
        script=SCRIPTS / "build_manifest.py",
        gate=PATHS.sft_gate,
        configs=[arm_toml(arm) for arm in ARMS],
        raw=sorted({f for arm in ARMS for f in arm_cfg(arm).data.files}),
    output:
        manifest=PATHS.manifest,
        shards=[shard for arm in ARMS for shard in arm_shards(arm).values()],
    log:
        PATHS.log("build_manifest"),
    benchmark:
        PATHS.benchmark("build_manifest")
    container:
        CONTAINER
    params:
        run=RUN_OVERRIDES,
    shell:
        "python {input.script} {input.configs} {params.run} > {log} 2>&1"
